"""File writing that never leaves a half-written file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from optimus_mllm.errors import OptimusError


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``."""
    path = Path(path)
    if not path.parent.is_dir():
        raise OptimusError(f"{path}: directory {path.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
