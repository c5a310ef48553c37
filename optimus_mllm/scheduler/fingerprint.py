"""What of a config shapes its schedule, as flat ``{"model.llm.num_layers": 4, ...}`` settings.

A schedule artifact stores the fingerprint of the config it was made for, so that a job can name the
first setting it differs in instead of failing after its ranks connect. Keys are written as
``--override`` takes them (``model.encoders.0.num_layers``). Every config field is in it unless
listed in ``_NOT_SCHEDULE`` (or, for the models, ``_NOT_SCHEDULE_IN_MODELS``), so a field added to
the config later counts until someone says why it does not.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from optimus_mllm.config import OptimusConfig

_NOT_SCHEDULE = frozenset(
    {
        "name",  # a label
        "source",  # the file the config was read from
        # how many steps run, not what a step does: resuming a job raises it
        "training.train_iters",
        # the optimizer's numbers, not the work of a step (its kind and SGD's momentum stay: they
        # set the optimizer states' memory)
        "training.lr",
        "training.min_lr",
        "training.lr_decay_style",
        "training.lr_warmup_iters",
        "training.lr_decay_iters",
        "training.override_opt_param_scheduler",
        "training.use_checkpoint_opt_param_scheduler",
        "training.weight_decay",
        "training.adam_beta1",
        "training.adam_beta2",
        "training.adam_eps",
        "training.clip_grad",
        "training.loss_scale",
        "training.initial_loss_scale",
        "training.min_loss_scale",
        "training.loss_scale_window",
        "training.hysteresis",
        "training.seed",
        # which schedule each step runs: the artifact is the job's plan either way
        "training.schedule_per_iteration",
        # where the samples come from and how their text is read: the shapes are the same. Not
        # data.max_images_per_microbatch: the encoder's memory and the fallback schedule are
        # planned for it
        "data.path",
        "data.tokenizer",
        "data.image_placeholder",
        "data.max_images_per_sample",
        "data.samples_per_sequence",
        # the workload distribution optimus-plan ranks plans over: the plans are compared
        "data.images_per_sample",
        "data.tokens_per_image",
        # The job compares the plans themselves (ScheduleArtifact.check_matches): a config that
        # fixes the plan the planner would have chosen is the same job, and without parallel.encoder
        # any plan the planner keeps will do.
        "parallel",
        "planner",  # search limits: where they matter, the plans they lead to are compared
        # decides which encoder plans fit, which load_job_artifact checks against the planner's
        # candidates; no kernel time depends on it (a Megatron job's config has the default)
        "cluster.gpu_memory_gib",
    }
)


# fields of any transformer (LLM or encoder) that no plan or priced kernel depends on: dropout's
# masks are elementwise work the cost model does not count
_NOT_SCHEDULE_IN_MODELS = frozenset({"hidden_dropout", "attention_dropout"})


def schedule_fingerprint(config: OptimusConfig) -> dict[str, Any]:
    """The config's settings that the plans, kernels and their costs depend on, by dotted path."""
    return config_settings(config, _NOT_SCHEDULE, _NOT_SCHEDULE_IN_MODELS)


def config_settings(
    config: OptimusConfig,
    skip: frozenset[str] = frozenset(),
    skip_in_models: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The config's settings by dotted path, as ``--override`` names them.

    Args:
        config: the loaded config.
        skip: paths left out, with everything under them.
        skip_in_models: field names left out of every transformer under ``model.``.

    Returns:
        ``{"model.llm.num_layers": 4, ...}``, in the config's field order.
    """
    return dict(_settings(config, "", skip, skip_in_models))


def _settings(
    value: Any, path: str, skip: frozenset[str], skip_in_models: frozenset[str]
) -> Iterator[tuple[str, Any]]:
    if path in skip or (path.startswith("model.") and path.rsplit(".", 1)[-1] in skip_in_models):
        return
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            name = f"{path}.{f.name}" if path else f.name
            yield from _settings(getattr(value, f.name), name, skip, skip_in_models)
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            yield from _settings(item, f"{path}.{i}", skip, skip_in_models)
    else:
        yield path, value


_ABSENT = object()


def fingerprint_difference(made: dict[str, Any], job: dict[str, Any]) -> str | None:
    """The first setting that differs, as ``key=made, this job has job``; None if none does."""
    for key in [*job, *(k for k in made if k not in job)]:
        a, b = made.get(key, _ABSENT), job.get(key, _ABSENT)
        if not _same(a, b):
            was = f"{key}={json.dumps(a)}" if a is not _ABSENT else f"no {key}"
            return f"{was}, this job has {json.dumps(b) if b is not _ABSENT else 'none'}"
    return None


def _same(a: Any, b: Any) -> bool:
    # JSON keeps 80.0 as 80.0 but a hand-written 80 is the same setting; true is not 1
    return a == b and isinstance(a, bool) == isinstance(b, bool)
