"""Megatron-LM's own ``pretrain_vlm.py`` on this machine's CPUs: the one command to see its numbers.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python scripts/megatron_lm_compare.py [MEGATRON_ARGS ...]

trains the checkout's unmodified ``pretrain_vlm.py`` (Megatron-LM tag ``core_v0.16.1``, the one
that goes with megatron-core 0.16.1) for 3 iterations on 4 gloo ranks at TP2 PP2, with Megatron's
own mock data and tiny sizes (``TINY_VLM_ARGS``, dropout 0), through
``optimus_mllm.megatron_lm_cpu`` (the CPU patches for ``megatron.training``), and prints Megatron's
``lm loss`` / ``grad norm`` of each iteration. ``MEGATRON_ARGS`` are appended (a later flag
wins), e.g. ``--swiglu``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Megatron-LM's flags for a tiny LLaVA (CLIP with its class token, the MLP projector) on the CPU:
# its mock data and null tokenizer, gloo, the local (torch) layers and no fused kernels. The vocab
# (255 + the null tokenizer's end-of-document token) is a multiple of 128 * TP for TP 1 and 2, so
# the padded vocab, and with it the weights --use-cpu-initialization draws, are the same at both.
TINY_VLM_ARGS = (
    *("--decoder-num-layers", "2", "--encoder-num-layers", "2"),
    *("--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4"),
    *("--seq-length", "16", "--dataloader-seq-length", "16", "--max-position-embeddings", "128"),
    *("--img-h", "32", "--img-w", "32", "--patch-dim", "16"),
    *("--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"),
    *("--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant", "--seed", "1234"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"),
    *("--distributed-backend", "gloo", "--transformer-impl", "local"),
    *("--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--rerun-mode", "disabled"),
    *("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"),
    *("--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion"),
    *("--hidden-dropout", "0", "--attention-dropout", "0"),
    *("--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000"),
    *("--ckpt-format", "torch"),
)

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


def run_megatron_script(
    script: Path, nproc: int, args: Sequence[str], timeout_s: float = 900
) -> Run:
    """``torchrun`` ``script`` on ``nproc`` local gloo ranks (``optimus_mllm.megatron_lm_cpu``).

    ``PYTHONPATH`` starts with this repository (its ``optimus_mllm`` is the one run);
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as Megatron-LM's examples set it (its ``validate_args``
    requires it at TP>1).
    """
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [environment.get("PYTHONPATH")])]
    )
    environment["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", str(nproc), "-m", "optimus_mllm.megatron_lm_cpu"),
        *(str(script), *args),
    ]
    result = subprocess.run(
        command,
        cwd=REPO,  # not the checkout: its .python-version may name another interpreter
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    return Run(result.returncode, parse_iterations(result.stdout), result.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER, help="more Megatron-LM flags")
    options = parser.parse_args(argv)
    checkout = megatron_lm_dir()
    if checkout is None or not (checkout / "pretrain_vlm.py").is_file():
        print(
            "megatron_lm_compare: error: set MEGATRON_LM_DIR to a Megatron-LM checkout at tag "
            "core_v0.16.1 (git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM)",
            file=sys.stderr,
        )
        return 2
    parallel = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    plain = run_megatron_script(
        checkout / "pretrain_vlm.py", 4, [*TINY_VLM_ARGS, *parallel, *options.megatron_args]
    )
    if plain.returncode != 0 or not plain.iterations:
        print(plain.output[-4000:], file=sys.stderr)
        print(f"megatron_lm_compare: error: the plain run failed (exit {plain.returncode})")
        return 1
    print("plain pretrain_vlm.py, 4 gloo ranks, TP2 PP2:")
    for iteration in plain.iterations:
        print(f"  {iteration.line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
