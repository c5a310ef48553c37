"""Megatron-LM's own ``pretrain_vlm.py`` on this machine's CPUs: the one command to see its numbers.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python scripts/megatron_lm_compare.py \
        [--layout tp2-pp2|dp2-pp2] [MEGATRON_ARGS ...]

trains the checkout's ``pretrain_vlm.py`` (Megatron-LM tag ``core_v0.16.1``, the one that goes
with megatron-core 0.16.1) for 3 iterations on 4 gloo ranks, with Megatron's own mock data and tiny
sizes (``TINY_VLM_ARGS``, dropout 0), through ``optimus_mllm.megatron.cpu`` (the CPU patches for
``megatron.training``), three times: unmodified; with the one-line opt-in (``from
optimus_mllm.megatron import pretrain``, ``ONE_LINE``) in a copy of the script; and that copy with
``--optimus-schedule auto``. It prints Megatron's ``lm loss`` / ``grad norm`` of each iteration of
each run and whether they agree. ``MEGATRON_ARGS`` are appended to all (a later flag wins), e.g.
``--swiglu``.

The script cannot run interleaved at this tag (``LAYOUTS``); ``tests/distributed/
test_megatron_seams.py`` covers the flag under virtual stages through a stand-in of Megatron-LM.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Megatron-LM's flags that run pretrain_vlm.py on the CPU, whatever the model: its mock data and
# null tokenizer, gloo, the local (torch) layers and no fused kernels, each iteration logged, no
# evaluation
CPU_VLM_ARGS = (
    *("--mock-data", "--tokenizer-type", "NullTokenizer"),
    *("--distributed-backend", "gloo", "--transformer-impl", "local"),
    *("--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--rerun-mode", "disabled"),
    *("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"),
    *("--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion"),
    *("--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000"),
    *("--ckpt-format", "torch"),
)

# Megatron-LM's flags for a tiny LLaVA (CLIP with its class token, the MLP projector) on the CPU,
# dropout 0. The vocab (255 + the null tokenizer's end-of-document token) is a multiple of
# 128 * TP for TP 1 and 2, so the padded vocab, and with it the weights --use-cpu-initialization
# draws, are the same at both.
TINY_VLM_ARGS = (
    *("--decoder-num-layers", "2", "--encoder-num-layers", "2"),
    *("--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4"),
    *("--seq-length", "16", "--dataloader-seq-length", "16", "--max-position-embeddings", "128"),
    *("--img-h", "32", "--img-w", "32", "--patch-dim", "16"),
    *("--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"),
    *("--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant", "--seed", "1234"),
    *("--vocab-size", "255", "--hidden-dropout", "0", "--attention-dropout", "0"),
    *CPU_VLM_ARGS,
)

ONE_LINE = "from optimus_mllm.megatron import pretrain"
# the opt-in goes after the script's last import, where it shadows megatron.training's pretrain
_LAST_IMPORT = "from pretrain_gpt import loss_func\n"

# " [date] iteration        1/       3 | ... | lm loss: 5.551649E+00 | ... | grad norm: 2.131 | ..."
_ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.E+-]+) \|.*\| grad norm: ([0-9.]+) \|"
)


@dataclass(frozen=True)
class Iteration:
    """What Megatron's training log prints for one iteration."""

    number: int
    lm_loss: float
    grad_norm: float
    line: str  # as printed


@dataclass(frozen=True)
class Run:
    """One training run: its exit status, the iterations it logged and its whole output."""

    returncode: int
    iterations: tuple[Iteration, ...]
    output: str


def megatron_lm_dir() -> Path | None:
    """The Megatron-LM checkout named by ``MEGATRON_LM_DIR``, or None when it is unset."""
    value = os.environ.get("MEGATRON_LM_DIR")
    return Path(value) if value else None


def parse_iterations(output: str) -> tuple[Iteration, ...]:
    """Megatron's per-iteration log lines in ``output``."""
    return tuple(
        Iteration(int(match[1]), float(match[2]), float(match[3]), match[0])
        for match in _ITERATION.finditer(output)
    )


# " ... iteration        3/       5 | ... | elapsed time per iteration (ms): 2731.4 | ..."
_ELAPSED = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|[^\n]*?\| elapsed time per iteration \(ms\): ([0-9.]+) \|"
)


def elapsed_ms(output: str) -> dict[int, float]:
    """Megatron's ``elapsed time per iteration (ms)`` by iteration number, as its training log
    prints it every ``--log-interval`` iterations (with 1, each iteration's own time)."""
    return {int(match[1]): float(match[2]) for match in _ELAPSED.finditer(output)}


def with_one_line(checkout: Path, folder: Path) -> Path:
    """A copy of ``checkout``'s ``pretrain_vlm.py`` in ``folder`` with the one-line opt-in.

    The copy finds the checkout's modules through ``MEGATRON_LM_DIR``
    (``optimus_mllm.megatron.cpu``).
    """
    source = (checkout / "pretrain_vlm.py").read_text()
    if source.count(_LAST_IMPORT) != 1:
        raise SystemExit(f"megatron_lm_compare: {checkout}/pretrain_vlm.py: no {_LAST_IMPORT!r}")
    script = folder / "pretrain_vlm.py"
    script.write_text(source.replace(_LAST_IMPORT, f"{_LAST_IMPORT}{ONE_LINE}\n"))
    return script


# 4 gloo ranks each. No interleaved layout: at core_v0.16.1 pretrain_vlm.py's providers take no
# vp_stage, which Megatron-LM passes under virtual pipeline stages, and with them added the
# interleaved schedule sizes its P2P by --seq-length, which the script sets to the vision model's
# sequence (a gloo size mismatch, without Optimus)
LAYOUTS = {
    "tp2-pp2": ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
    "dp2-pp2": ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"),
}


def agree(first: Run, second: Run, rel: float = 1e-5) -> bool:
    """The same iterations, with losses within ``rel`` and grad norms as printed (3 decimals)."""
    return len(first.iterations) == len(second.iterations) > 0 and all(
        a.number == b.number
        and math.isclose(a.lm_loss, b.lm_loss, rel_tol=rel)
        and abs(a.grad_norm - b.grad_norm) <= 2e-3
        for a, b in zip(first.iterations, second.iterations)
    )


def run_megatron_script(
    script: Path,
    nproc: int,
    args: Sequence[str],
    timeout_s: float = 900,
    nodes: int = 1,
    variables: Mapping[str, str] | None = None,
) -> Run:
    """``torchrun`` ``script`` on ``nproc`` local gloo ranks (``optimus_mllm.megatron.cpu``);
    with ``nodes`` > 1, on ``nodes`` torchrun agents of ``nproc`` ranks each, started on their own
    and meeting through torchrun's c10d rendezvous as the nodes of a cluster do.

    ``PYTHONPATH`` starts with this repository (its ``optimus_mllm`` is the one run);
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as Megatron-LM's examples set it (its ``validate_args``
    requires it at TP>1); ``variables`` are set over this process's environment. The output is
    every agent's, one after the other; the exit status the first non-zero one.
    """
    environment = {**os.environ, **(variables or {})}
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [environment.get("PYTHONPATH")])]
    )
    environment["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if nodes == 1:
        launcher: tuple[str, ...] = ("--standalone",)
    else:
        port = _free_port()
        launcher = (
            *("--nnodes", str(nodes), "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"megatron-lm-{port}"),
        )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", *launcher),
        *("--nproc-per-node", str(nproc), "-m", "optimus_mllm.megatron.cpu"),
        *(str(script), *args),
    ]
    agents = [
        subprocess.Popen(
            command,
            cwd=REPO,  # not the checkout: its .python-version may name another interpreter
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(nodes)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        outputs = [a.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for a in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    output = "".join(outputs)
    returncode = next((a.returncode for a in agents if a.returncode != 0), 0)
    return Run(returncode, parse_iterations(output), output)


def _free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


AUTO = ("--optimus-schedule", "auto")


def optimus_schedule_file(args: Sequence[str], out: Path) -> tuple[str, str]:
    """The flag that runs Optimus's fastest schedule for the job of ``args`` on 4 ranks, from a
    plan file ``optimus-plan`` writes: ``--optimus-schedule auto`` trains as Megatron-LM does where
    Optimus is not predicted to gain, and a check of the flag's own path needs it to run."""
    from optimus_mllm.cli.plan import main as optimus_plan

    argv = ["--world-size", "4", "--gpus-per-node", "4", "--artifact", str(out), "--", *args]
    if optimus_plan(argv) != 0:
        raise RuntimeError(f"optimus-plan could not plan the job {list(args)}")
    return ("--optimus-schedule", str(out))


def resume_across_the_flag(
    one_line: Path, args: Sequence[str], folder: Path, flag: Sequence[str] = AUTO
) -> dict[str, Run]:
    """Checkpoints across the flag: the one-line script trained to iteration 4 without the flag
    (saving at 2 on the way) and to 2 with it (saving there), then each checkpoint resumed at 2
    to 4 the other way (``--ckpt-step 2``), checkpoints under ``folder``. Iteration 4 is the first
    that the resumed optimizer state shapes."""
    args = [*args, "--train-iters", "4"]
    plain, flagged = folder / "saved-without", folder / "saved-with"
    every_2 = ("--save-interval", "2")
    return {
        "uninterrupted, without the flag": run_megatron_script(
            one_line, 4, [*args, "--save", str(plain), *every_2]
        ),
        "with the flag, saved at 2": run_megatron_script(
            one_line, 4, [*args, "--save", str(flagged), *every_2, "--exit-interval", "2", *flag]
        ),
        "saved without, resumed with the flag": run_megatron_script(
            one_line, 4, [*args, "--load", str(plain), "--ckpt-step", "2", *flag]
        ),
        "saved with the flag, resumed without": run_megatron_script(
            one_line, 4, [*args, "--load", str(flagged), "--ckpt-step", "2"]
        ),
    }


# a checkpoint's entries that differ by design between two runs of the same numbers: the command
# line (--optimus-schedule, the folders) and the random generators' states
UNCOMPARED = frozenset({"args", "rng_state"})


def state_differences(first: Any, second: Any, rel: float = 1e-4, where: str = "") -> list[str]:
    """Where two loaded checkpoint states differ: the same nested keys, tensors of the same dtype
    and shape within ``rel`` of the first's largest magnitude, other values equal (floats within
    ``rel``); the ``UNCOMPARED`` entries left out. Empty where they agree."""
    import torch

    if isinstance(first, dict) and isinstance(second, dict):
        keys, other_keys = ([k for k in d if k not in UNCOMPARED] for d in (first, second))
        if sorted(map(repr, keys)) != sorted(map(repr, other_keys)):
            return [
                f"{where or '/'}: keys {sorted(map(repr, keys))} vs {sorted(map(repr, other_keys))}"
            ]
        return [
            d for k in keys for d in state_differences(first[k], second[k], rel, f"{where}/{k}")
        ]
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        if len(first) != len(second):
            return [f"{where}: {len(first)} entries vs {len(second)}"]
        pairs = enumerate(zip(first, second))
        return [d for i, (a, b) in pairs for d in state_differences(a, b, rel, f"{where}/{i}")]
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return _tensor_differences(first, second, rel, where)
    if isinstance(first, float) and isinstance(second, float):
        return [] if math.isclose(first, second, rel_tol=rel) else [f"{where}: {first} vs {second}"]
    return [] if first == second else [f"{where}: {first!r} vs {second!r}"]


def _tensor_differences(first: Any, second: Any, rel: float, where: str) -> list[str]:
    if (first.dtype, first.shape) != (second.dtype, second.shape):
        return [
            f"{where}: {first.dtype} {list(first.shape)} vs {second.dtype} {list(second.shape)}"
        ]
    if first.numel() == 0:
        return []
    a, b = first.double(), second.double()
    error, largest = float((a - b).abs().max()), float(a.abs().max())
    if error > rel * max(largest, 1e-12):
        return [f"{where}: differs by {error:.3g} (largest magnitude {largest:.3g})"]
    return []


def checkpoint_differences(first: Path, second: Path, rel: float = 1e-4) -> list[str]:
    """Where two Megatron-LM checkpoint folders (``iter_NNNNNNN``) differ: the same files, each's
    loaded state as ``state_differences`` compares them."""
    import torch

    names = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    others = sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    if names != others:
        return [f"files {names} vs {others}"]
    return [
        d
        for name in names
        for d in state_differences(
            torch.load(first / name, weights_only=False),
            torch.load(second / name, weights_only=False),
            rel,
            name,
        )
    ]


def distributed_optimizer_checkpoints(
    one_line: Path, args: Sequence[str], folder: Path, flag: Sequence[str] = AUTO
) -> dict[str, Run]:
    """--use-distributed-optimizer checkpoints across the flag: the one-line script trained to
    iteration 4 without and with the flag, saving there (``folder``/saved-without, saved-with),
    then each checkpoint resumed to 6 without and with it: six launches, titled."""
    args = [*args, "--use-distributed-optimizer", "--train-iters", "6"]
    at_4 = ("--save-interval", "4", "--exit-interval", "4")
    saved = {"without": folder / "saved-without", "with": folder / "saved-with"}
    flags = {"without": (), "with": tuple(flag)}
    runs = {
        f"{way} the flag, saved at 4": run_megatron_script(
            one_line, 4, [*args, "--save", str(saved[way]), *at_4, *flags[way]]
        )
        for way in saved
    }
    for source in saved:
        for way in flags:
            runs[f"saved {source} the flag, resumed {way} it"] = run_megatron_script(
                one_line, 4, [*args, "--load", str(saved[source]), *flags[way]]
            )
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2-pp2")
    parser.add_argument(
        "--across-the-flag",
        action="store_true",
        help="instead: save and resume checkpoints across --optimus-schedule (4 runs)",
    )
    # every other argument is a Megatron-LM flag for the runs
    options, megatron_args = parser.parse_known_args(argv)
    checkout = megatron_lm_dir()
    if checkout is None or not (checkout / "pretrain_vlm.py").is_file():
        print(
            "megatron_lm_compare: error: set MEGATRON_LM_DIR to a Megatron-LM checkout at tag "
            "core_v0.16.1 (git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM)",
            file=sys.stderr,
        )
        return 2
    args = [*TINY_VLM_ARGS, *LAYOUTS[options.layout], *megatron_args]
    if options.across_the_flag:
        return _print_resume_across_the_flag(checkout, args, options.layout)
    with tempfile.TemporaryDirectory() as folder:
        one_line = with_one_line(checkout, Path(folder))
        cases = {
            "unmodified pretrain_vlm.py": (checkout / "pretrain_vlm.py", ()),
            f"pretrain_vlm.py + {ONE_LINE!r}": (one_line, ()),
            f"pretrain_vlm.py + {ONE_LINE!r}, --optimus-schedule auto": (
                one_line,
                ("--optimus-schedule", "auto"),
            ),
        }
        runs = []
        for title, (path, flag) in cases.items():
            run = run_megatron_script(path, 4, [*args, *flag])
            if run.returncode != 0 or not run.iterations:
                print(run.output[-4000:], file=sys.stderr)
                print(f"megatron_lm_compare: error: {title} failed (exit {run.returncode})")
                return 1
            print(f"{title}, 4 gloo ranks, {options.layout}:")
            for line in run.output.splitlines():
                if line.startswith("optimus:"):
                    print(f"  {line}")
            for iteration in run.iterations:
                print(f"  {iteration.line}")
            runs.append(run)
    same = all(agree(runs[0], run) for run in runs[1:])
    print(f"same lm loss (relative 1e-5) and grad norm in all three: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _print_resume_across_the_flag(checkout: Path, args: list[str], layout: str) -> int:
    with tempfile.TemporaryDirectory() as folder:
        runs = resume_across_the_flag(with_one_line(checkout, Path(folder)), args, Path(folder))
    for title, run in runs.items():
        if run.returncode != 0 or not run.iterations:
            print(run.output[-4000:], file=sys.stderr)
            print(f"megatron_lm_compare: error: {title} failed (exit {run.returncode})")
            return 1
        print(f"{title}, 4 gloo ranks, {layout}:")
        for iteration in run.iterations:
            print(f"  {iteration.line}")
    print(
        "(Megatron-LM logs a resumed run's first iteration without resetting its loss sum: "
        "it prints at 4 the mean of 3 and 4)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
