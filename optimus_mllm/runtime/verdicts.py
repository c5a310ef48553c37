"""What only some ranks can see, heard by every rank: the user's modules live on the first pipeline
stage and a batch is read on TP rank 0, but every rank must go on with the same value, or refuse
together, or the ones that go on wait in a collective for the ones that stopped."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

from optimus_mllm.errors import OptimusError

T = TypeVar("T")


def heard_by_every_rank(
    report: tuple[T | None, str | None] | None, none_reported: str | None = None
) -> list[T]:
    """Every value the ranks reported, in rank order, on every rank (collective over the world).

    Args:
        report: this rank's ``(value, None)``, ``(None, problem)`` (a one-line problem), or None
            (or ``(None, None)``) where it has nothing to say.
        none_reported: the problem where no rank reported a value (default: a bug).

    Raises:
        OptimusError: on every rank, the first problem any rank reported.
    """
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, report)
    said = [r for r in seen if r is not None]
    problems = [problem for _, problem in said if problem is not None]
    if problems:
        raise OptimusError(problems[0])
    values = [value for value, _ in said if value is not None]
    if not values and none_reported is not None:
        raise OptimusError(none_reported)
    assert values, "no rank reported a value"
    return values
