"""File writing that never leaves a half-written file behind, and reading that never waits: a path
the user names is read only when it is a regular file, so that a FIFO with no writer (or a device)
is refused in one line instead of blocking ``open`` or ``read`` forever."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from optimus_mllm.errors import OptimusError

ENERGON_META = ".nv-meta"  # energon's metadata folder: what makes data.path a webdataset


def is_webdataset(path: str | Path | None) -> bool:
    """Whether ``path`` (``data.path``; None: no dataset) is an energon dataset (it has
    ``.nv-meta``): multimodal samples whose microbatches vary in images, where a captions.jsonl has
    one image per sample."""
    return path is not None and (Path(path) / ENERGON_META).is_dir()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``; synced, so that
    the file is whole on disk once this returns, with the mode a plain ``open`` would give it."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """``atomic_write_text`` for bytes."""
    path = Path(path)
    if not path.parent.is_dir():
        raise OptimusError(f"{path}: directory {path.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from the user's group
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
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


def special_file_kind(mode: int) -> str | None:
    """What a ``st_mode`` names when it is neither a regular file nor a directory, else None."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def read_regular_file(path: str | Path, limit: int = -1) -> bytes:
    """The bytes (at most ``limit``, all when -1) of the regular file at ``path``.

    Raises:
        OSError: as ``open`` raises it; IsADirectoryError for a directory, and an OSError whose
        ``strerror`` says what the path is for a FIFO, socket or device.
    """
    # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one; the
    # file kind is then read from the open descriptor, so a rename in between cannot slip past.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        kind = special_file_kind(mode)
        if kind:
            raise OSError(errno.EINVAL, f"is {kind}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return handle.read(limit)


def special_entries(folder: str | Path) -> list[str]:
    """The names in ``folder`` (recursively) that are neither regular files nor directories, each
    with what it is: reading one (a FIFO, a device) could block forever."""
    found = []
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(parent, name)
            try:
                kind = special_file_kind(os.stat(path).st_mode)
            except OSError:  # a dangling link: its reader reports it as missing
                continue
            if kind:
                found.append(f"{os.path.relpath(path, folder)} ({kind})")
    return sorted(found)


def read_versioned_json(
    path: str | Path, what: str, file_format: str, version: int, remedy: str
) -> dict[str, Any]:
    """Read a JSON file of ``file_format`` at ``version``; ``remedy`` says how to make a good
    one."""
    try:
        data = json.loads(read_regular_file(path).decode("utf-8"))
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
