"""megatron-core's checkpoint writer, run synchronously without the process it keeps for async
saves.

``FileSystemWriterAsync`` hands its write results back through a queue made by a ``multiprocessing``
Manager (``filesystem_async._get_write_results_queue``), so that an asynchronous save can finish in
another process. The Manager is a process of its own, started with ``spawn``: it re-imports the
training script (torch and megatron-core, seconds of CPU and hundreds of MB per rank) and cannot be
started at all from a daemonic process. A synchronous save writes and collects in this process, so
``synchronous_writer`` gives it a plain queue for the duration of the save.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator

from megatron_patches.lookup import import_module, require


@contextlib.contextmanager
def synchronous_writer() -> Iterator[None]:
    """Within the block, megatron-core's writer collects its results in an in-process queue."""
    writer = import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    original = require(writer, "_get_write_results_queue")
    results: queue.Queue = queue.Queue()
    writer._get_write_results_queue = lambda: results
    try:
        yield
    finally:
        writer._get_write_results_queue = original
