"""Whether the GPU code paths have run on a GPU: until they have, each one warns once per process.

The CUDA side stream, training on a GPU, ``optimus-profile`` and ``scripts/bench_gpu.py`` are
written and tested on CPU only. ``VERIFIED_ON`` names the ``scripts/gpu_truth.sh`` run that verified
them once one has passed; while it is None their users are told, on one stderr line per path, that
the numbers they get come from code no GPU has run yet.
"""

from __future__ import annotations

import os
import sys

VERIFIED_ON: str | None = None  # e.g. "2026-12-01, H100 80GB, bash scripts/gpu_truth.sh"
_warned: set[str] = set()


def warn_unverified(path: str) -> None:
    """One line on stderr (rank 0 only) the first time this process uses the unverified GPU
    ``path``."""
    if VERIFIED_ON is not None or path in _warned:
        return
    _warned.add(path)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"optimus: warning: {path} has not yet run on a GPU (issue 16); its results are "
            "unverified",
            file=sys.stderr,
            flush=True,
        )
