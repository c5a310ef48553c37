"""Seeded fuzzing of the inputs a user hands the project: configs, --override values, schedule
artifacts,
checkpoint folders, datasets and Megatron-LM flags.

    python -m tests.support.fuzz_inputs --cases N [--seed S] [--limit SEC (10)] [--json OUT]

Each case takes a valid input, damages it one way (a value, a key, the file's bytes) and hands it to
what reads it before any rank connects: ``load_config`` and the planner (``optimus-plan``, and every
rank of ``optimus-train``), ``load_job_artifact`` (``--schedule``), ``latest_checkpoint``
(``--resume``), ``check_dataset`` and the image decoder (``data.path``), and
``config_from_megatron_args`` with the planner (a flag of ``scripts/pretrain_vlm_megatron.py``).
Every outcome is one of

    ok        accepted, where the damage may leave a valid input
    refused   an OptimusError: the entry points print it as one line and exit 2

or a failure: TRACEBACK (any other exception), HANG (over ``--limit`` seconds) or ACCEPTED (an input
that is invalid by construction went through). One row per kind of input, the failures after it;
exit code 1 if there is any, 2 on bad arguments. The valid checkpoint the checkpoint cases damage is
written first by a 1-rank ``optimus-train`` run (about 20 s).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from optimus_mllm.cli.common import ArgumentParser
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.config.yaml_input import parse_yaml
from optimus_mllm.errors import OptimusError

from .paths import MEGATRON_TINY_FLAGS, REPO

TINY = REPO / "configs" / "tiny.yaml"
KINDS = (
    "config value",
    "config key",
    "config bytes",
    "override",
    "artifact",
    "checkpoint",
    "dataset",
    "megatron args",
)
# values no field takes; and values some field may
INVALID_VALUES = [
    float("nan"),
    float("inf"),
    float("-inf"),
    {"nested": {"mapping": 1}},
    [[["deep"]]],
]
MAYBE_VALUES = [
    0,
    -1,
    1,
    2,
    3,
    7,
    64,
    1e-9,
    1e9,
    2**31,
    10**16,
    "",
    "x" * 300,
    True,
    False,
    None,
    "fp8",
    0.5,
]
OVERRIDE_TEXTS = [
    "[",
    "{",
    "'open",
    '"',
    "!!python/object/apply:os.system ['true']",
    "*nowhere",
    "&a [*a]",
    ".nan",
    "-.inf",
    "1e400",
    "0x10",
    "~",
    "[1, 2",
    "{a: 1, a: 2}",
    "9" * 5000,
    "- - - x",
    "\t",
]


@dataclass(frozen=True)
class Case:
    kind: str
    index: int
    what: str  # the damage, in words
    invalid: bool  # invalid by construction: must be refused


@dataclass
class Outcome:
    case: Case
    result: str  # ok, refused, TRACEBACK, HANG, ACCEPTED
    detail: str
    seconds: float


class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang()


# -- the valid inputs ------------------------------------------------------------------------------


class Inputs:
    """The valid inputs the cases damage, made once in ``root``."""

    def __init__(self, root: Path, with_checkpoint: bool):
        from optimus_mllm.config import load_config
        from optimus_mllm.planner import plan
        from optimus_mllm.scheduler.artifact import schedule_job_artifact
        from optimus_mllm.scheduler.artifact_format import artifact_to_json

        self.root = root
        self.config_text = TINY.read_text()
        self.raw = parse_yaml(self.config_text)
        self.config = load_config(TINY)
        self.planned = plan(self.config)
        # the JSON a file holds, which the artifact cases edit
        self.artifact = artifact_to_json(schedule_job_artifact(self.config, self.planned))
        self.dataset = root / "dataset"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_sample_dataset.py"),
                "--format",
                "captions",
                "--out",
                str(self.dataset),
                "--num-samples",
                "8",
                "--size",
                "16",
            ],
            check=True,
            capture_output=True,
        )
        from optimus_mllm.megatron.core_training import build_parser, parse_args

        self.megatron_parse_args = parse_args
        self.megatron_parser = build_parser
        self.checkpoint = root / "checkpoint" if with_checkpoint else None
        if self.checkpoint is not None:
            one_rank = [
                "cluster.num_gpus=1",
                "cluster.gpus_per_node=1",
                "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
                "training.train_iters=2",
            ]
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    "1",
                    "-m",
                    "optimus_mllm.train",
                    "--config",
                    str(TINY),
                    "--override",
                    *one_rank,
                    "--save",
                    str(self.checkpoint),
                    "--save-interval",
                    "1",
                ],
                check=True,
                capture_output=True,
                cwd=REPO,
            )


# -- damage ----------------------------------------------------------------------------------------


def _leaves(tree: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(tree, list):
        return [leaf for i, value in enumerate(tree) for leaf in _leaves(value, (*path, i))]
    return [path]


def _sections(tree: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(tree, dict):
        return [path] + [s for key, value in tree.items() for s in _sections(value, (*path, key))]
    if isinstance(tree, list):
        return [s for i, value in enumerate(tree) for s in _sections(value, (*path, i))]
    return []


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _yaml(value: Any) -> str:
    return (
        json.dumps(value, allow_nan=True)
        .replace("NaN", ".nan")
        .replace("-Infinity", "-.inf")
        .replace("Infinity", ".inf")
    )


def _dump(raw: dict) -> str:
    """A config as YAML (JSON is YAML; the non-finite floats in YAML's spelling)."""
    return _yaml(raw)


def _value(rng: random.Random) -> tuple[Any, bool]:
    """(a value, whether it is invalid for any field)."""
    if rng.random() < 0.5:
        return copy.deepcopy(rng.choice(INVALID_VALUES)), True
    return copy.deepcopy(rng.choice(MAYBE_VALUES)), False


def _config_value(
    inputs: Inputs, rng: random.Random, tmp: Path
) -> tuple[Callable[[], Any], str, bool]:
    raw = copy.deepcopy(inputs.raw)
    path = rng.choice(_leaves(raw))
    value, invalid = _value(rng)
    _at(raw, path[:-1])[path[-1]] = value
    file = tmp / "config.yaml"
    file.write_text(_dump(raw))
    return (
        lambda: _plan_config(file, []),
        f"{'.'.join(map(str, path))} = {str(value)[:40]}",
        invalid,
    )


def _config_key(
    inputs: Inputs, rng: random.Random, tmp: Path
) -> tuple[Callable[[], Any], str, bool]:
    raw = copy.deepcopy(inputs.raw)
    section = rng.choice([s for s in _sections(raw) if s != ("parallel", "llm")])
    node = _at(raw, section)
    if rng.random() < 0.5 or not node:
        node["no_such_field"] = 1
        what, invalid = f"unknown key under {'.'.join(map(str, section)) or 'the top'}", True
    else:
        key = rng.choice(list(node))
        del node[key]
        what, invalid = f"{'.'.join(map(str, (*section, key)))} deleted", False
    file = tmp / "config.yaml"
    file.write_text(_dump(raw))
    return lambda: _plan_config(file, []), what, invalid


def _config_bytes(
    inputs: Inputs, rng: random.Random, tmp: Path
) -> tuple[Callable[[], Any], str, bool]:
    data = inputs.config_text.encode()
    choice = rng.randrange(5)
    if choice == 0:
        cut = rng.randrange(len(data))
        data, what, invalid = data[:cut], f"cut at byte {cut}", False
    elif choice == 1:
        at = rng.randrange(len(data))
        data, what, invalid = data[:at] + b"\xff" + data[at:], f"byte 0xff at {at}", True
    elif choice == 2:
        block = rng.choice(
            [
                line
                for line in inputs.config_text.splitlines()
                if line and not line[0].isspace() and not line.startswith("#")
            ]
        )
        data, what, invalid = data + f"\n{block}\n".encode(), f"'{block}' again", ":" in block
    elif choice == 3:
        depth = rng.choice([40, 500, 5000])
        data, what, invalid = (
            data + b"\nextra: " + b"[" * depth + b"]" * depth,
            f"nesting {depth} deep",
            True,
        )
    else:
        data, what, invalid = (
            bytes(rng.randrange(256) for _ in range(200)),
            "200 random bytes",
            True,
        )
    file = tmp / "config.yaml"
    file.write_bytes(data)
    return lambda: _plan_config(file, []), what, invalid


def _override(inputs: Inputs, rng: random.Random, tmp: Path) -> tuple[Callable[[], Any], str, bool]:
    path = rng.choice(_leaves(inputs.raw))
    key = ".".join(map(str, path))
    text = rng.choice(OVERRIDE_TEXTS)
    try:
        parse_yaml(text)
        invalid = False
    except ValueError:
        invalid = True
    if rng.random() < 0.2:
        key, invalid = key + ".nowhere", True
    return lambda: _plan_config(TINY, [f"{key}={text}"]), f"{key}={text[:30]}", invalid


def _plan_config(file: Path, overrides: list[str]) -> None:
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan

    plan(load_config(file, overrides))


def _artifact(inputs: Inputs, rng: random.Random, tmp: Path) -> tuple[Callable[[], Any], str, bool]:
    from optimus_mllm.scheduler.artifact import load_job_artifact

    data = copy.deepcopy(inputs.artifact)
    file = tmp / "artifact.json"
    choice = rng.randrange(4)
    if choice == 0:
        path = rng.choice(_leaves(data))
        value, invalid = (
            (rng.choice(INVALID_VALUES), True)
            if rng.random() < 0.5
            else (rng.choice(["text", -5, 10**20]), False)
        )
        _at(data, path[:-1])[path[-1]] = value
        text, what = json.dumps(data), f"{'.'.join(map(str, path))} = {str(value)[:30]}"
    elif choice == 1:
        section = rng.choice([s for s in _sections(data) if _at(data, s)])
        key = rng.choice(list(_at(data, section)))
        del _at(data, section)[key]
        # every top-level field is required; deeper ones may have defaults
        text, what, invalid = (
            json.dumps(data),
            f"{'.'.join(map(str, (*section, key)))} deleted",
            section == (),
        )
    elif choice == 2:
        text = json.dumps(data)
        cut = rng.randrange(len(text))
        text, what, invalid = text[:cut], f"cut at character {cut}", True
    else:
        file.write_bytes(bytes(rng.randrange(256) for _ in range(300)))
        return (
            (lambda: load_job_artifact(file, inputs.planned, inputs.config, 4)),
            "300 random bytes",
            True,
        )
    file.write_text(text)
    return lambda: load_job_artifact(file, inputs.planned, inputs.config, 4), what, invalid


def _checkpoint(
    inputs: Inputs, rng: random.Random, tmp: Path
) -> tuple[Callable[[], Any], str, bool]:
    """Damage the newest checkpoint (iter_0000002) or the tracker; resuming must then take
    iter_0000001 or
    refuse, never the damaged one."""
    from optimus_mllm.runtime.checkpoint_meta import (
        check_resumable,
        latest_checkpoint,
        optimizer_layout,
        optimizer_layout_change,
    )

    root = tmp / "checkpoint"
    shutil.copytree(inputs.checkpoint, root)
    newest = root / "iter_0000002"
    files = sorted(p for p in newest.iterdir() if p.is_file() and p.name != "schedule.json")
    choice = rng.randrange(5)
    if choice == 0:
        tracker = bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        (root / "latest_checkpointed_iteration.txt").write_bytes(tracker)
        what, damaged = f"tracker {tracker!r}", False
    elif choice == 1:
        victim = rng.choice(files)
        victim.unlink()
        what, damaged = f"{victim.name} deleted", True
    elif choice == 2:
        victim = rng.choice(files)
        size = victim.stat().st_size
        victim.write_bytes(victim.read_bytes()[: rng.randrange(size)] if size else b"")
        what, damaged = f"{victim.name} cut short", True
    elif choice == 3:
        meta = json.loads((newest / "meta.json").read_text())
        path = rng.choice(_leaves(meta))
        value = rng.choice(INVALID_VALUES[3:] + [None, "text", -1])
        damaged = _at(meta, path) != value
        _at(meta, path[:-1])[path[-1]] = value
        (newest / "meta.json").write_text(json.dumps(meta))
        what = f"meta.json {'.'.join(map(str, path))} = {value!r}"
    else:
        (newest / "meta.json").write_bytes(bytes(rng.randrange(256) for _ in range(100)))
        what, damaged = "meta.json random bytes", True

    def resume() -> None:  # the launcher's checks, in its order
        info = latest_checkpoint(root)
        check_resumable(info, inputs.config)
        if optimizer_layout_change(info, optimizer_layout(inputs.config)) is not None:
            raise OptimusError("the optimizer layout differs")
        if damaged and info.path == newest:
            raise _Accepted(f"resumes from the damaged {newest.name}")

    return resume, what, False


class _Accepted(Exception):
    """A check inside a case found an invalid input taken for a valid one."""


def _dataset(inputs: Inputs, rng: random.Random, tmp: Path) -> tuple[Callable[[], Any], str, bool]:
    from optimus_mllm.config import load_config
    from optimus_mllm.runtime.data import ImageTextDataset
    from optimus_mllm.runtime.data_sources import check_dataset

    root = tmp / "dataset"
    shutil.copytree(inputs.dataset, root)
    captions = root / "captions.jsonl"
    lines = captions.read_text().splitlines()
    choice = rng.randrange(5)
    decode = False
    if choice == 0:
        i = rng.randrange(len(lines))
        lines[i] = rng.choice(
            [
                '{"image": 1, "text": "x"}',
                '{"text": "only text"}',
                "[1, 2]",
                "{",
                '"a string"',
                '{"image": "images/none.png", "text": "no such file"}',
                '{"image": "images/000000.png"}',
            ]
        )
        captions.write_text("\n".join(lines) + "\n")
        what, invalid = f"line {i + 1}: {lines[i][:40]}", True
    elif choice == 1:
        captions.write_bytes(captions.read_bytes()[:5] + b"\xff\xfe" + captions.read_bytes()[5:])
        what, invalid = "captions.jsonl not UTF-8", True
    elif choice == 2:
        image = rng.choice(sorted((root / "images").iterdir()))
        data = image.read_bytes()
        image.write_bytes(data[: rng.randrange(len(data))])
        # maybe still whole: a cut in the trailing chunk leaves every pixel
        what, invalid, decode = f"{image.name} cut short", False, True
    elif choice == 3:
        image = rng.choice(sorted((root / "images").iterdir()))
        data = bytearray(image.read_bytes())
        for _ in range(8):
            data[rng.randrange(len(data))] = rng.randrange(256)
        image.write_bytes(bytes(data))
        what, invalid, decode = f"{image.name} with 8 random bytes", False, True
    else:
        captions.write_text("")
        what, invalid = "captions.jsonl empty", True
    config = load_config(TINY, [f"data.path={root}"])

    def read() -> None:
        check_dataset(config)
        if decode:
            dataset = ImageTextDataset(config)
            for index in range(len(dataset.captions)):
                dataset._sample_images(index)

    return read, what, invalid


MEGATRON_BASE = list(MEGATRON_TINY_FLAGS)
INT_TEXTS = ["0", "-1", "1", "2", "3", "7", "64", "1000000000", "10000000000000000"]
FLOAT_TEXTS = ["nan", "inf", "-inf", "0", "-1", "1e-9", "1e9", "0.5", "1e400"]


def _megatron_args(
    inputs: Inputs, rng: random.Random, tmp: Path
) -> tuple[Callable[[], Any], str, bool]:
    """One flag of scripts/pretrain_vlm_megatron.py (Megatron-LM's names and defaults) set to a
    drawn value,
    read by ``config_from_megatron_args`` and planned, as the script does before any rank
    connects."""
    from optimus_mllm.megatron.arguments import add_optimus_args
    from optimus_mllm.megatron.flags import config_from_megatron_args
    from optimus_mllm.planner import plan

    actions = [
        a for a in inputs.megatron_parser()._actions if a.option_strings and a.dest != "help"
    ]
    action = rng.choice(actions)
    flag = action.option_strings[0]
    invalid = False
    if action.nargs == 0:  # store_true / store_false
        argv, value = [flag], "(set)"
    elif action.choices is not None:
        value = rng.choice([*map(str, action.choices), "bogus"])
        argv = [flag, value]
    elif action.type is float:
        value = rng.choice(FLOAT_TEXTS)
        argv, invalid = [flag, value], value in ("nan", "inf", "-inf", "1e400")
    else:
        value = rng.choice(INT_TEXTS)
        argv = [flag, value]

    def read() -> None:
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage and error lines
                args = inputs.megatron_parse_args(add_optimus_args, MEGATRON_BASE + argv)
        except SystemExit as exc:  # argparse's own refusal (exit 2)
            raise OptimusError(f"argparse exit {exc.code}") from None
        plan(config_from_megatron_args(args, 4, 4))

    return read, f"{flag} {value}", invalid


GENERATORS = {
    "config value": _config_value,
    "config key": _config_key,
    "config bytes": _config_bytes,
    "override": _override,
    "artifact": _artifact,
    "checkpoint": _checkpoint,
    "dataset": _dataset,
    "megatron args": _megatron_args,
}


# -- running ---------------------------------------------------------------------------------------


def run_case(inputs: Inputs, kind: str, index: int, seed: int, limit: float) -> Outcome:
    rng = random.Random(f"{seed}:{kind}:{index}")
    with tempfile.TemporaryDirectory(dir=inputs.root) as folder:
        action, what, invalid = GENERATORS[kind](inputs, rng, Path(folder))
        case = Case(kind, index, what, invalid)
        started = time.monotonic()
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            action()
            result, detail = ("ACCEPTED", "went through") if invalid else ("ok", "")
        except _Accepted as exc:
            result, detail = "ACCEPTED", str(exc)
        except _Hang:
            result, detail = "HANG", f"over {limit:g} s"
        except OptimusError as exc:
            result, detail = "refused", str(exc).splitlines()[0] if str(exc) else ""
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            result, detail = "TRACEBACK", f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return Outcome(case, result, detail, time.monotonic() - started)


def fuzz(
    cases: int, seed: int, limit: float, work: Path, kinds: tuple[str, ...] = KINDS
) -> list[Outcome]:
    inputs = Inputs(work, with_checkpoint="checkpoint" in kinds)
    return [
        run_case(inputs, kinds[i % len(kinds)], i // len(kinds), seed, limit) for i in range(cases)
    ]


FAILURES = ("TRACEBACK", "HANG", "ACCEPTED")


def table(outcomes: list[Outcome]) -> list[str]:
    columns = ("ok", "refused", *FAILURES)
    rows = [f"{'input':<14}{'cases':>7}" + "".join(f"{c:>11}" for c in columns) + f"{'max s':>8}"]
    for kind in dict.fromkeys(o.case.kind for o in outcomes):
        mine = [o for o in outcomes if o.case.kind == kind]
        counts = Counter(o.result for o in mine)
        rows.append(
            f"{kind:<14}{len(mine):>7}"
            + "".join(f"{counts[c]:>11}" for c in columns)
            + f"{max(o.seconds for o in mine):>8.2f}"
        )
    counts = Counter(o.result for o in outcomes)
    rows.append(
        f"{'all':<14}{len(outcomes):>7}"
        + "".join(f"{counts[c]:>11}" for c in columns)
        + f"{max(o.seconds for o in outcomes):>8.2f}"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="fuzz_inputs", description="Seeded fuzzing of every input a user gives"
    )
    parser.add_argument(
        "--cases", type=int, default=500, help="cases, spread over the kinds of input (default 500)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit", type=float, default=10.0, help="seconds a case may take (default 10)"
    )
    parser.add_argument("--json", metavar="OUT", help="also write every outcome as JSON")
    args = parser.parse_args(argv)
    if args.cases < 1 or not math.isfinite(args.limit) or args.limit <= 0:
        parser.error("--cases must be >= 1 and --limit a positive number of seconds")
    with tempfile.TemporaryDirectory() as work:
        outcomes = fuzz(args.cases, args.seed, args.limit, Path(work))
    print("\n".join(table(outcomes)))
    failed = [o for o in outcomes if o.result in FAILURES]
    for o in failed:
        print(f"{o.result}: {o.case.kind} #{o.case.index}: {o.case.what}: {o.detail}")
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                [
                    {
                        **asdict(o.case),
                        "result": o.result,
                        "detail": o.detail,
                        "seconds": round(o.seconds, 3),
                    }
                    for o in outcomes
                ],
                indent=1,
            )
            + "\n",
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
