"""Checkpoints: resuming gives the uninterrupted run's losses, gradient norms and learning rates
(AdamW moments, step counts and the LR schedule restored), on the plans and runtime that wrote it or
on others; a failed or killed write keeps the previous one; the layout is megatron-core's.

The launcher tests train the tiny config on 4 CPU processes (torchrun); the others drive
``save_checkpoint`` / ``load_checkpoint`` on gloo ranks in-process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.distributed_utils import run_distributed
from support.train_utils import (
    TINY,
    assert_one_error_everywhere,
    encoder_under_megatron_names,
    plain_vision_model,
    ranks,
    step_numbers,
    torchrun,
)

pytestmark = pytest.mark.distributed

SIX = "training.train_iters=6"
# warm-up, then cosine decay: the resumed steps' learning rates come from the restored schedule;
# dropout: its masks come from the iteration and microbatch alone, so no generator state needs
# restoring
RUN = [
    "training.lr_warmup_iters=2",
    "training.lr_decay_style=cosine",
    "training.lr=1e-3",
    "training.min_lr=1e-4",
    *(
        f"model.{part}.{name}=0.1"
        for part in ("llm", "encoders.0")
        for name in ("hidden_dropout", "attention_dropout")
    ),
]
TWO_RANKS = [
    "cluster.num_gpus=2",
    "cluster.gpus_per_node=2",
    "parallel.llm={dp: 1, pp: 2, tp: 1, vp: 2}",
]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, str]:
    return step_numbers(torchrun("--override", SIX, *RUN))


@pytest.fixture(scope="module")
def first_half(tmp_path_factory) -> Path:
    """Steps 1-3 of the 6-step run, checkpointed after each step."""
    save = tmp_path_factory.mktemp("ckpt") / "run"
    lines = torchrun(
        "--override",
        SIX,
        *RUN,
        "training.train_iters=3",
        "training.lr_decay_iters=6",
        "--save",
        str(save),
        "--save-interval",
        "1",
    )
    assert [line for line in lines if line.startswith("saved checkpoint")] == [
        f"saved checkpoint {save / f'iter_000000{i}'}" for i in (1, 2, 3)
    ]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert not list(save.glob("*.tmp"))
    return save


def test_resume_gives_the_uninterrupted_losses(uninterrupted, first_half, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(first_half, save)
    lines = torchrun(
        "--override", SIX, *RUN, "training.lr_decay_iters=6", "--save", str(save), "--resume"
    )
    assert lines[0] == f"resumed from {save / 'iter_0000003'} at step 3"
    assert lines[1] == "schedule: the one saved with the checkpoint"
    resumed = step_numbers(lines)
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {step: uninterrupted[step] for step in (4, 5, 6)}
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6\n"


def test_resume_without_the_optimizer_state(uninterrupted, first_half, tmp_path):
    """Another optimizer: the saved optimizer state cannot load; with --no-load-optim the weights
    and the LR
    schedule do (here on 2 ranks: the encoder schedule is re-planned)."""
    save = tmp_path / "run"
    shutil.copytree(first_half, save)
    resume = ("--save", str(save), "--resume")
    assert_one_error_everywhere(
        ranks(
            4,
            "--override",
            SIX,
            *RUN,
            "training.lr_decay_iters=6",
            "training.optimizer=sgd",
            *resume,
        ),
        "optimizer layout.optimizer differs from this job's",
    )
    assert_one_error_everywhere(
        ranks(4, "--override", SIX, *RUN, "--no-load-optim"), "--no-load-optim applies to --resume"
    )
    lines = torchrun(
        "--override",
        SIX,
        *RUN,
        "training.lr_decay_iters=6",
        *TWO_RANKS,
        *resume,
        "--no-load-optim",
        nproc=2,
    )
    assert (
        lines[1]
        == "the checkpoint was written by 4 ranks, this job has 2: re-planned the encoder schedule"
    )
    resumed = step_numbers(lines)
    assert sorted(resumed) == [4, 5, 6]
    # the schedule's position came back: the same learning rates; a fresh Adam state gives other
    # numbers
    assert [resumed[s].split("| lr ")[1] for s in (4, 5, 6)] == [
        uninterrupted[s].split("| lr ")[1] for s in (4, 5, 6)
    ]
    assert resumed[5] != uninterrupted[5]


def test_resume_errors_on_every_rank(first_half, tmp_path):
    assert_one_error_everywhere(ranks(4, "--resume"), "--resume needs --save DIR")
    assert_one_error_everywhere(
        ranks(4, "--save", str(tmp_path / "empty"), "--resume"), "no checkpoint in"
    )
    assert_one_error_everywhere(
        ranks(
            4, "--override", SIX, "model.llm.num_layers=8", "--save", str(first_half), "--resume"
        ),
        "model.llm.num_layers differs from the checkpoint",
    )
    assert_one_error_everywhere(
        ranks(4, "--save", str(first_half), "--resume"),
        "raise training.train_iters to train further",
    )


# -- an interrupted write ------------------------------------------------------------------------


def _interrupted(save: str) -> dict:
    """Save after step 1; rank 1's writer finds the disk full while saving after step 2; reload and
    redo
    step 2."""
    import errno
    import functools
    import os

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime import checkpoint, checkpoint_meta
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(TINY)
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned)
    trainer = Trainer(config, planned.llm_plan, "optimus", artifact)
    trainer.train_step(0)
    checkpoint.save_checkpoint(trainer, save, 1)
    second = trainer.train_step(1).loss

    real_write = filesystem_async._write_item

    @functools.wraps(real_write)  # the writer inspects its signature
    def failing_write(*args, **kwargs):
        result = real_write(*args, **kwargs)
        if torch.distributed.get_rank() == 1:  # a tensor is already on disk when the writer fails
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a full disk
        return result

    filesystem_async._write_item = failing_write  # megatron-core's writer processes fork with it
    try:
        checkpoint.save_checkpoint(trainer, save, 2)
        error = None
    except OptimusError as exc:
        error = str(exc)
    finally:
        filesystem_async._write_item = real_write
    trainer.close()

    info = checkpoint_meta.latest_checkpoint(save)
    fresh = Trainer(config, planned.llm_plan, "optimus", artifact)
    checkpoint.load_checkpoint(fresh, info)
    redo = fresh.train_step(1).loss
    fresh.close()
    return {"error": error, "latest": info.iteration, "second": second, "redo": redo}


def test_failed_write_keeps_the_previous_checkpoint_loadable(tmp_path):
    save = tmp_path / "run"
    results = run_distributed(_interrupted, 4, str(save), timeout=240)
    assert [r["error"] for r in results] == [
        f"checkpoint writing failed: no space left on {save}; free space there or point --save "
        "elsewhere; the "
        "previous checkpoint is still the latest"
    ] * 4
    assert [r["latest"] for r in results] == [1] * 4
    assert not (save / "iter_0000002.tmp").exists() and not (save / "iter_0000002").exists()
    losses = [(r["second"], r["redo"]) for r in results if r["second"] is not None]
    assert losses and all(second == redo for second, redo in losses)


def test_killed_writer_leftovers_do_not_count(first_half, tmp_path):
    """A writer killed before publishing leaves only an ``.tmp`` folder: the latest stays, and
    resuming works."""
    save = tmp_path / "run"
    shutil.copytree(first_half, save)
    shutil.rmtree(save / "iter_0000003")
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    shutil.copytree(first_half / "iter_0000003", save / "iter_0000003.tmp")
    (save / "iter_0000003.tmp" / "meta.json").unlink()
    lines = torchrun(
        "--override",
        *RUN,
        "training.train_iters=3",
        "training.lr_decay_iters=6",
        "--save",
        str(save),
        "--resume",
    )
    assert lines[0] == f"resumed from {save / 'iter_0000002'} at step 2"
    assert (
        not (save / "iter_0000003.tmp").exists() and (save / "iter_0000003" / "meta.json").is_file()
    )


def _weights_after_an_update_with_a_fresh_optimizer(save: str) -> dict:
    """bf16 on one rank: train 2 steps and save; a fresh job loads the weights with a fresh
    optimizer (``--no-load-optim``) and takes an update from zero gradients (no weight decay), which
    leaves the optimizer's fp32 main weights as they are and writes them into the model's."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime import checkpoint, checkpoint_meta
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(
        TINY,
        [
            "cluster.num_gpus=1",
            "cluster.gpus_per_node=1",
            "training.precision=bf16",
            "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
            "training.lr=1e-2",
            "training.weight_decay=0",
        ],
    )
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned)

    def weights(trainer: Trainer) -> dict:
        modules = [*trainer.chunks, trainer.encoder]
        return {
            f"{i}.{name}": p.detach().float().numpy().copy()
            for i, module in enumerate(modules)
            for name, p in module.named_parameters()
        }

    trained = Trainer(config, planned.llm_plan, "optimus", artifact)
    trained.train_step(0)
    trained.train_step(1)
    checkpoint.save_checkpoint(trained, save, 2)
    saved = weights(trained)
    trained.close()
    fresh = Trainer(config, planned.llm_plan, "optimus", artifact)
    initial = weights(fresh)
    checkpoint.load_checkpoint(fresh, checkpoint_meta.latest_checkpoint(save), load_optimizer=False)
    for model in fresh.ddp_models:
        model.zero_grad_buffer()
    fresh.optimizer.step()
    after = weights(fresh)
    fresh.close()
    return {"saved": saved, "initial": initial, "after": after}


def test_no_load_optim_updates_the_loaded_weights(tmp_path):
    """The optimizer's fp32 main weights are reloaded from the loaded bf16 ones, as Megatron-LM
    does; they
    used to keep the initial weights, which the first update then wrote back over the loaded
    ones."""
    [result] = run_distributed(
        _weights_after_an_update_with_a_fresh_optimizer, 1, str(tmp_path / "run"), timeout=180
    )
    assert all((result["saved"][name] != result["initial"][name]).any() for name in result["saved"])
    for name, weight in result["saved"].items():
        assert (result["after"][name] == weight).all(), name


# -- resharding, across runtimes, and the layout --------------------------------------------------

# the encoder's dropout masks are drawn for the whole tensor (plan-independent); the LLM's attention
# dropout is megatron-core's, drawn per TP rank, so a TP change draws other masks: off here
FOUR = ["training.train_iters=4", *(item for item in RUN if not item.startswith("model.llm."))]


def _trainer(overrides: list[str], mode: str):
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(TINY, [*FOUR, *overrides])
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned) if mode == "optimus" else None
    return Trainer(config, planned.llm_plan, mode, artifact)


def _optimizer_tensors(trainer) -> list:
    """This rank's optimizer state in parameter order: fp32 main weights and Adam's moments."""
    from megatron_patches.optimizer import parts

    tensors = []
    for part in parts(trainer.optimizer):
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                state = part.optimizer.state[param]
                tensors += [
                    param.detach().clone(),
                    state["exp_avg"].clone(),
                    state["exp_avg_sq"].clone(),
                ]
    return tensors


PP4 = ["parallel.llm={dp: 1, pp: 4, tp: 1, vp: 1}", "parallel.encoder={pp: 2, tp: 1}"]


def _resumed_through(
    save: str, second: tuple[list[str], str], third: tuple[list[str], str]
) -> dict:
    """A chain of jobs over one checkpoint folder. The Megatron-style baseline (TP2 PP2 V2) trains 2
    steps, saves, and trains 2 more: the uninterrupted numbers. ``second`` (overrides, runtime)
    loads that, trains step 3, saves, trains step 4; ``third`` loads the second's checkpoint and
    trains step 4."""
    from optimus_mllm.runtime import checkpoint, checkpoint_meta

    def numbers(result):
        return result.loss, result.grad_norm, result.lr

    first = _trainer([], "baseline")
    for i in (0, 1):
        first.train_step(i)
    checkpoint.save_checkpoint(first, save, 2)
    uninterrupted = [numbers(first.train_step(i)) for i in (2, 3)]
    first.close()
    job = _trainer(*second)
    checkpoint.load_checkpoint(job, checkpoint_meta.latest_checkpoint(save))
    resumed = [numbers(job.train_step(2))]
    checkpoint.save_checkpoint(job, save, 3)
    resumed.append(numbers(job.train_step(3)))
    job.close()
    job = _trainer(*third)
    checkpoint.load_checkpoint(job, checkpoint_meta.latest_checkpoint(save))
    resumed.append(numbers(job.train_step(3)))
    job.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def _step_values(results: list[dict], run: str) -> list[tuple[float, float, float]]:
    """(loss, grad norm, LR) per step; every plan here has one LLM replica, so its last stage's
    ranks all
    print the loss."""
    values = []
    for step in range(len(results[0][run])):
        losses = {r[run][step][0] for r in results} - {None}
        norms, lrs = {r[run][step][1] for r in results}, {r[run][step][2] for r in results}
        assert len(losses) == len(norms) == len(lrs) == 1, (losses, norms, lrs)
        values.append((losses.pop(), norms.pop(), lrs.pop()))
    return values


@pytest.mark.parametrize(
    "second, third",
    [((PP4, "optimus"), ([], "baseline")), (([], "balanced"), ([], "optimus"))],
    ids=["optimus-pp4-then-baseline", "balanced-then-optimus"],
)
def test_resume_onto_other_plans_and_runtimes(tmp_path, second, third):
    """Baseline -> Optimus with the LLM from TP2 PP2 V2 to PP4 and the encoder from TP2 in the first
    stage
    to its own PP2 plan -> baseline; and baseline -> the balanced baseline (encoder and LLM layers
    split together over TP2 PP2 V2) -> Optimus: every resumed step within 1e-5 of the uninterrupted
    one."""
    results = run_distributed(
        _resumed_through, 4, str(tmp_path / "run"), second, third, timeout=300
    )
    uninterrupted = _step_values(results, "uninterrupted")
    for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(
        _step_values(results, "resumed"), [*uninterrupted, uninterrupted[1]], strict=True
    ):
        assert abs(loss - want_loss) < 1e-5 and abs(norm - want_norm) < 1e-5 and lr == want_lr


def _state_after_resuming(save: str) -> dict:
    """The same plans (the distributed optimizer sharded over two replicas): the optimizer's state
    saved
    and loaded, and the steps after it with and without the interruption."""
    from optimus_mllm.runtime import checkpoint, checkpoint_meta

    plan = ["parallel.llm={dp: 2, pp: 2, tp: 1, vp: 1}"]
    first = _trainer(plan, "optimus")
    for i in (0, 1):
        first.train_step(i)
    checkpoint.save_checkpoint(first, save, 2)
    saved = _optimizer_tensors(first)
    after = [(r.loss, r.grad_norm) for r in (first.train_step(2), first.train_step(3))]
    first.close()
    second = _trainer(plan, "optimus")
    checkpoint.load_checkpoint(second, checkpoint_meta.latest_checkpoint(save))
    loaded = _optimizer_tensors(second)
    resumed = [(r.loss, r.grad_norm) for r in (second.train_step(2), second.train_step(3))]
    second.close()
    same = len(saved) == len(loaded) and all(
        a.shape == b.shape and bool((a == b).all()) for a, b in zip(saved, loaded)
    )
    return {"same_state": same, "uninterrupted": after, "resumed": resumed}


def test_the_optimizer_state_survives_exactly(tmp_path):
    """Every rank gets back its fp32 main weights and Adam moments bit for bit, and the next steps
    are the
    uninterrupted ones."""
    results = run_distributed(_state_after_resuming, 4, str(tmp_path / "run"), timeout=300)
    assert all(r["same_state"] for r in results)
    assert [r["resumed"] for r in results] == [r["uninterrupted"] for r in results]


def _plain_megatron_weights(save: str) -> dict:
    """A plain megatron-core script: build the tiny LLM as a GPTModel and the encoder as a
    CLIPViTModel and MultimodalProjector on one rank, and load them from the checkpoint with
    dist_checkpointing (the CPU shims are what any megatron-core job on CPU needs); beside it, the
    same checkpoint loaded by the baseline runtime on one rank."""
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    import megatron_patches
    from optimus_mllm.runtime import checkpoint, checkpoint_meta

    megatron_patches.apply()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=256,
        max_sequence_length=64,
        share_embeddings_and_output_weights=False,
    )
    clip, projector = plain_vision_model(config)
    parts = {"language_model.": gpt, "vision_model.": clip, "vision_projection.": projector}
    folder = checkpoint_meta.latest_checkpoint(save).path
    state = dist_checkpointing.load(
        {
            "model": {
                key: value
                for prefix, module in parts.items()
                for key, value in module.sharded_state_dict(prefix=prefix).items()
            }
        },
        str(folder),
    )
    plain = {}
    for prefix, module in parts.items():
        module.load_state_dict(
            {
                key.removeprefix(prefix): value
                for key, value in state["model"].items()
                if key.startswith(prefix)
            }
        )
        plain.update(
            {prefix + name: p.detach().numpy().copy() for name, p in module.named_parameters()}
        )
    parallel_state.destroy_model_parallel()
    megatron_patches.remove()

    ours = _trainer(
        [
            "cluster.num_gpus=1",
            "cluster.gpus_per_node=1",
            "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
            # the weights are compared, not the LR schedule, which first_half set otherwise
            "training.use_checkpoint_opt_param_scheduler=true",
        ],
        "baseline",
    )

    def weights() -> dict:  # ours under the plain job's names
        named = {f"language_model.{name}": p for name, p in ours.chunks[0].named_parameters()}
        named.update(encoder_under_megatron_names(ours.encoder, "vit"))
        return {name: p.detach().numpy().copy() for name, p in named.items()}

    initial = weights()
    checkpoint.load_checkpoint(ours, checkpoint_meta.latest_checkpoint(save), load_optimizer=False)
    loaded = weights()
    ours.close()
    return {"plain": plain, "initial": initial, "ours": loaded}


def test_a_plain_megatron_core_script_loads_the_llm_and_the_encoder(first_half):
    """The checkpoint (written by 4 ranks: LLM TP2 PP2 V2, the encoder under its own plan) is
    megatron-core's layout: dist_checkpointing.load into a plain GPTModel, CLIPViTModel and
    MultimodalProjector on one rank gives the weights this project's loader gives."""
    [result] = run_distributed(_plain_megatron_weights, 1, str(first_half), timeout=240)
    assert result["plain"].keys() == result["ours"].keys()
    assert any(name.startswith("vision_model.conv1") for name in result["plain"])
    for name, weight in result["plain"].items():
        assert (weight == result["ours"][name]).all(), name
        assert not (weight == result["initial"][name]).all() or weight.ndim < 2, name


def _received(name: str, args: tuple) -> int:
    """Elements a rank receives in one call of torch.distributed's ``name``."""
    if name in ("all_gather", "gather"):
        outputs = args[0] if name == "all_gather" else (args[1] if len(args) > 1 else None)
        return sum(t.numel() for t in outputs or [])
    return args[
        0
    ].numel()  # all_gather_into_tensor / reduce_scatter_tensor: the output; broadcast, all_reduce


def _collectives_while_saving(save: str) -> dict:
    """Every tensor collective a rank takes part in while saving: its group's ranks and the elements
    it receives; the rank's data-parallel groups and parameter count."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from optimus_mllm.runtime import checkpoint

    trainer = _trainer(
        ["parallel.llm={dp: 2, pp: 1, tp: 2, vp: 1}", "parallel.encoder={pp: 1, tp: 2}"], "optimus"
    )
    trainer.train_step(0)
    seen = []

    def recording(name, original):
        def call(*args, **kwargs):
            group = kwargs.get("group") or next(
                (a for a in args if isinstance(a, dist.ProcessGroup)), None
            )
            ranks = (
                tuple(dist.get_process_group_ranks(group))
                if group
                else tuple(range(dist.get_world_size()))
            )
            seen.append((name, ranks, _received(name, args)))
            return original(*args, **kwargs)

        return call

    names = [
        "all_gather",
        "all_gather_into_tensor",
        "gather",
        "broadcast",
        "all_reduce",
        "reduce_scatter_tensor",
    ]
    originals = {name: getattr(dist, name) for name in names}
    for name, original in originals.items():
        setattr(dist, name, recording(name, original))
    try:
        checkpoint.save_checkpoint(trainer, save, 1)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    # this rank's own shard as megatron-core's DDP lays it out (its buckets padded for the
    # reduce-scatter)
    params = sum(
        buffer.grad_data.numel() for module in trainer.ddp_models for buffer in module.buffers
    )
    dp_groups = {
        tuple(dist.get_process_group_ranks(group))
        for group in (trainer.groups.dp_group, parallel_state.get_data_parallel_group())
    }
    trainer.close()
    return {"seen": seen, "params": params, "dp_groups": dp_groups}


def test_saving_gathers_nothing_beyond_a_ranks_own_shard(tmp_path):
    """LLM and encoder both TP2 DP2: a rank only ever exchanges tensors with its data-parallel
    replicas (copies of its own shard: the distributed optimizer's state, gathered onto DP rank 0),
    never with its TP peers, and receives at most three times its own parameters (main weights and
    Adam's two moments, in DDP's padded buckets); nothing is gathered whole."""
    results = run_distributed(_collectives_while_saving, 4, str(tmp_path / "run"), timeout=240)
    received = [
        [(name, group, size) for name, group, size in r["seen"] if size > 1] for r in results
    ]
    assert sum(map(len, received)) > 0, "the distributed optimizer gathers its state onto DP rank 0"
    for result, tensors in zip(results, received):
        assert all(group in result["dp_groups"] for _, group, _ in tensors), tensors
        assert sum(size for _, _, size in tensors) <= 3 * result["params"]


# -- a resumed LR schedule with changed settings (Megatron-LM's rule) ----------------------------

ONE_RANK = [
    "cluster.num_gpus=1",
    "cluster.gpus_per_node=1",
    "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
]


def _lrs(lines: list[str]) -> dict[int, str]:
    return {step: numbers.split("| lr ")[1] for step, numbers in step_numbers(lines).items()}


def test_a_changed_lr_schedule_resumes_only_as_told(tmp_path):
    """Saved with train_iters=2 (linear decay over 2 steps), resumed with train_iters=4: refused in
    one line naming Megatron-LM's two flags; --override-opt_param-scheduler decays over this run's 4
    steps, --use-checkpoint-opt_param-scheduler keeps the checkpoint's 2, so steps 3-4 train at
    min_lr, as Megatron-LM documents. (The flags set the YAML fields of their names, and both at
    once are refused: test_job_settings.)"""
    first = tmp_path / "first"
    torchrun("--override", *ONE_RANK, "training.train_iters=2", "--save", str(first), nproc=1)
    four = ("--override", *ONE_RANK, "training.train_iters=4")
    uninterrupted = _lrs(torchrun(*four, nproc=1))

    def resumed(name: str, *extra: str) -> list[str]:
        save = tmp_path / name
        shutil.copytree(first, save)
        return torchrun(*four, *extra, "--save", str(save), "--resume", nproc=1)

    assert_one_error_everywhere(
        ranks(1, *four, "--save", str(first), "--resume"),
        "--resume: the LR schedule's decay iterations (training.lr_decay_iters, else train_iters) "
        "is 4 in this run and 2 in the checkpoint; add --override-opt_param-scheduler to use this "
        "run's settings or --use-checkpoint-opt_param-scheduler to use the checkpoint's",
    )
    override = _lrs(resumed("override", "--override-opt_param-scheduler"))
    assert override == {step: uninterrupted[step] for step in (3, 4)}
    assert override[3] != "0.000e+00"
    checkpoint = _lrs(resumed("checkpoint", "--use-checkpoint-opt_param-scheduler"))
    assert checkpoint == {3: "0.000e+00", 4: "0.000e+00"}
