"""Every rank read its job, and the same job: checked as soon as the ranks connect.

On one machine, torchrun starts every rank from one command line, reading one copy of each file, so
a problem with the job is the same decision on every rank, made before any rank connects. On
several, each node's launcher (a torchrun per node, started by hand or by ``srun``) starts its ranks
from that node's own command line and files: the config, the schedule artifact, the data, the
checkpoint folder. Seen with two torchrun "nodes" before this check:

- a node whose copy of a file is missing stopped its ranks before they connected, silently (only
  rank 0 reports such an error), while the other node's ranks waited for them in the connection
  handshake until its timeout;
- a node launched with another ``--override training.lr`` trained with it: numbers that are neither
  job's, silently. Another plan or schedule leaves ranks waiting for messages that never come.

So on several nodes a rank that cannot read its job still connects, and right after connecting every
rank shares its one-line problem, if any, and a digest of what it read (one small all-gather). Only
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

LAUNCH_ALIKE = "launch every node with the same command and the same files"


def check_same_job(settings: Mapping[str, Any] | None, problem: str | None = None) -> None:
    """Raise ``AgreedError`` on every rank if a rank could not read its job, or if a rank's
    ``settings`` are not rank 0's.

    Args:
        settings: what this rank read its job as, by name (``config_settings`` of the config and
            the job's other inputs): values JSON can write, or whose ``str`` tells them apart. None
            with ``problem``.
        problem: the one-line error this rank met reading its job, if any.

    Raises:
        AgreedError: the problem, when every rank met the same one; else the first rank that met
            one, its host and its problem; else the first rank whose settings differ from rank 0's,
            both hosts, the first setting they differ in and both values.
    """
    host = socket.gethostname()
    digest = None if settings is None else _digest(settings)
    shared: list[tuple[str, str | None, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shared, (host, problem, digest))
    hosts, problems, digests = zip(*shared)  # type: ignore[misc]
    failed = [rank for rank, said in enumerate(problems) if said is not None]
    if failed and len(failed) == len(problems) and len(set(problems)) == 1:
        raise AgreedError(problems[0])
    if failed:
        rank = failed[0]
        raise AgreedError(f"rank {rank} (host {hosts[rank]}): {problems[rank]}")
    rank = next((r for r, digest in enumerate(digests) if digest != digests[0]), None)
    if rank is None:
        return
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(settings or {}))
    ours, theirs = gathered[0], gathered[rank]
    assert ours is not None and theirs is not None
    key = next(k for k in [*ours, *theirs] if _shown(ours.get(k)) != _shown(theirs.get(k)))
    raise AgreedError(
        f"rank {rank} (host {hosts[rank]}) runs another job than rank 0 (host {hosts[0]}): {key} "
        f"is {_shown(theirs.get(key))} there, {_shown(ours.get(key))} on rank 0; {LAUNCH_ALIKE}"
    )


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _digest(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(_shown(dict(settings)).encode()).hexdigest()
