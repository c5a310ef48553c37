"""Microbatch partitions: how the N_mb microbatches of one LLM pipeline split over its m encoder
pipelines.

Every encoder pipeline gets at least one microbatch (the paper lists [1,7] ... [7,1] for N=8, m=2),
so there are C(N-1, m-1) compositions. Two reductions keep the scheduler's search small:

- Symmetry: counts of interchangeable pipelines (see ``plans.symmetry_groups``) are kept in
  non-increasing order, which removes only schedules identical to a kept one.
- Cap: partitions are taken in rings of growing spread around the even split (first every part
  within [floor(N/m), ceil(N/m)], then one wider on each side, ...) until ``cap`` are kept; the ring
  that crosses the cap is cut in lexicographic order. The even split is always kept. The cut can
  drop the best partition, so the output says when it happened.

A pipeline that would hold activations of more than ``max_per_pipeline`` microbatches does not fit
in memory, so larger parts are never generated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class PartitionSet:
    partitions: tuple[tuple[int, ...], ...]
    num_compositions: int  # all compositions of N into m positive parts, before any reduction
    truncated: bool  # True when the cap cut the enumeration short


def microbatch_partitions(
    num_microbatches: int, groups: list[int], max_per_pipeline: int, cap: int
) -> PartitionSet:
    """Canonical partitions of ``num_microbatches`` over ``sum(groups)`` pipelines, most even
    first."""
    m = sum(groups)
    total = math.comb(num_microbatches - 1, m - 1) if num_microbatches >= m else 0
    hi_limit = min(max_per_pipeline, num_microbatches - m + 1)
    if m > num_microbatches or hi_limit * m < num_microbatches:
        return PartitionSet((), total, False)
    even_lo, even_hi = num_microbatches // m, -(-num_microbatches // m)
    kept: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    widen = 0
    while True:
        lo, hi = max(1, even_lo - widen), min(hi_limit, even_hi + widen)
        for part in _canonical(num_microbatches, groups, lo, hi):
            if part in seen:
                continue
            if len(kept) == cap:
                return PartitionSet(tuple(kept), total, True)
            seen.add(part)
            kept.append(part)
        if lo == 1 and hi == hi_limit:
            return PartitionSet(tuple(kept), total, False)
        widen += 1


def _canonical(total: int, groups: list[int], lo: int, hi: int) -> Iterator[tuple[int, ...]]:
    """Parts in [lo, hi] summing to ``total``, non-increasing inside each symmetry group."""
    group_of = [g for g, size in enumerate(groups) for _ in range(size)]
    m = len(group_of)
    parts = [0] * m

    def max_rest(j: int, cap_same: int) -> int:
        # Largest sum positions j.. can still take: same-group ones are capped by the last value.
        same = sum(1 for k in range(j, m) if group_of[k] == group_of[j - 1]) if j > 0 else 0
        return same * cap_same + (m - j - same) * hi

    def place(j: int, remaining: int) -> Iterator[tuple[int, ...]]:
        if j == m:
            if remaining == 0:
                yield tuple(parts)
            return
        upper = hi
        if j > 0 and group_of[j] == group_of[j - 1]:
            upper = min(upper, parts[j - 1])
        for value in range(min(upper, remaining), lo - 1, -1):
            rest = remaining - value
            if rest < lo * (m - j - 1) or rest > max_rest(j + 1, value):
                continue
            parts[j] = value
            yield from place(j + 1, rest)

    yield from place(0, total)
