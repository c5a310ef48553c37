"""Every rank runs the same job: checked as soon as the ranks connect.

On one machine, torchrun starts every rank from one command line, reading one copy of each file. On
several, each node's launcher (a torchrun per node, started by hand or by ``srun``) starts its ranks
from that node's own command line and files: the config, the schedule artifact, the checkpoint
folder. A node launched with another ``--override``, or whose copy of a file differs, still joins
the rendezvous. Its ranks then train with their own settings: another learning rate gives numbers
that are neither job's, silently (seen with two torchrun nodes, one with ``training.lr=5e-4``);
another plan or schedule leaves ranks waiting for messages that never come.

So right after connecting, the ranks compare a digest of what each read (one small all-gather); only
when the digests differ do they gather the settings themselves, to name the first setting and a rank
that differs from rank 0, with both hosts. Every rank raises the same ``AgreedError``.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from optimus_mllm.errors import AgreedError


def check_same_job(settings: Mapping[str, Any]) -> None:
    """Raise ``AgreedError`` on every rank unless every rank's ``settings`` are rank 0's.

    Args:
        settings: what this rank read its job as, by name (``config_settings`` of the config and
            the job's other inputs); values JSON can write, or anything whose ``str`` tells them
            apart.

    Raises:
        AgreedError: naming the first rank that differs from rank 0, both hosts, and the first
            setting they differ in, with both values.
    """
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(settings))
    rank = next((r for r, digest in enumerate(digests) if digest != digests[0]), None)
    if rank is None:
        return
    gathered: list[tuple[str, dict[str, Any]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), dict(settings)))
    (host_0, ours), (host, theirs) = gathered[0], gathered[rank]  # type: ignore[misc]
    key = next(k for k in [*ours, *theirs] if _shown(ours.get(k)) != _shown(theirs.get(k)))
    raise AgreedError(
        f"rank {rank} (host {host}) runs another job than rank 0 (host {host_0}): {key} is "
        f"{_shown(theirs.get(key))} there, {_shown(ours.get(key))} on rank 0; launch every node "
        "with the same command and the same files"
    )


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _digest(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(_shown(dict(settings)).encode()).hexdigest()
