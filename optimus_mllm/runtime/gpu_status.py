"""Which GPU code paths have run on a GPU: until one has, it warns once per process.

The CUDA side stream, training on GPUs, ``optimus-profile``, ``benchmarks/bench_gpu.py`` and METP's
P2P side stream are written and tested on CPU. ``VERIFIED`` names, for each path a
``scripts/gpu_truth.sh`` run has checked, that run; every other path tells its users, on one stderr
line, that the numbers they get come from code no GPU has run yet.
"""

from __future__ import annotations

import os
import sys

_H100_RUN = "2026-11-27, one H100 80GB HBM3, scripts/gpu_truth.sh"
VERIFIED: dict[str, str] = {
    # test_streams: side-stream training equals inline and the baseline; bench_gpu row 2: 91.6 %
    # of the encoder hidden under a window
    "the CUDA side stream for encoder ops": _H100_RUN,
    # bench_gpu row 4: seven steps' losses equal the baseline's to bf16 rounding
    "training on one GPU": _H100_RUN,
    "optimus-profile": _H100_RUN,
    "benchmarks/bench_gpu.py": _H100_RUN,
    # not yet: "training on several GPUs" (NCCL) and "METP's P2P side stream" need several GPUs
}
_warned: set[str] = set()


def warn_unverified(path: str) -> None:
    """One line on stderr (rank 0 only) the first time this process uses the GPU ``path``, unless a
    GPU run verified it."""
    if path in VERIFIED or path in _warned:
        return
    _warned.add(path)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"optimus: warning: {path} has not yet run on a GPU; its results are unverified",
            file=sys.stderr,
            flush=True,
        )
