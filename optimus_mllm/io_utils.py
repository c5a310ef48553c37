"""File writing that never leaves a half-written file behind."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from optimus_mllm.errors import OptimusError


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``; synced, so that
    the file is whole on disk once this returns, with the mode a plain ``open`` would give it."""
    path = Path(path)
    if not path.parent.is_dir():
        raise OptimusError(f"{path}: directory {path.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from the user's group
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    """Sync a directory, so that the renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """Sync every file and directory under ``path`` (and ``path`` itself)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def read_versioned_json(
    path: str | Path, what: str, file_format: str, version: int, remedy: str
) -> dict[str, Any]:
    """Read a JSON file of ``file_format`` at ``version``; ``remedy`` says how to make a good
    one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OptimusError(f"{what} {path} does not exist; {remedy}") from None
    except IsADirectoryError:
        raise OptimusError(f"{what} {path} is a directory, not a JSON file; {remedy}") from None
    except OSError as exc:
        raise OptimusError(f"{what} {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise OptimusError(f"{what} {path} is not a text file (not UTF-8); {remedy}") from None
    except json.JSONDecodeError as exc:
        raise OptimusError(
            f"{what} {path} is not valid JSON (line {exc.lineno}); {remedy}"
        ) from None
    except RecursionError:  # the parser takes a Python frame per nested bracket
        raise OptimusError(
            f"{what} {path} is not valid JSON (nested too deeply); {remedy}"
        ) from None
    if not isinstance(data, dict) or data.get("format") != file_format:
        raise OptimusError(f"{what} {path} is not an {file_format} file")
    if data.get("version") != version:
        raise OptimusError(
            f"{what} {path} has version {data.get('version')}, this release reads version "
            f"{version}; {remedy}"
        )
    return data
