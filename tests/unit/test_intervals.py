"""FreeIntervals against a plain list of intervals searched front to back."""

from __future__ import annotations

import random

import pytest

from optimus_mllm.scheduler.intervals import FreeIntervals


class _SmallBlocks(FreeIntervals):
    BLOCK = 3  # blocks split and empty within a few placements


def _reference_fit(free: list[list[float]], t: float, duration: float, limit: float):
    """First fit by the definition: the earliest start >= t inside one interval, ending by
    ``limit``."""
    for a, b in free:
        start = max(a, t)
        if start + duration <= b and start + duration <= limit:
            return start, a, b
    return None


def _reference_occupy(free: list[list[float]], start: float, end: float) -> None:
    for i, (a, b) in enumerate(free):
        if a <= start and end <= b:
            free[i : i + 1] = [piece for piece in ([a, start], [end, b]) if piece[1] > piece[0]]
            return
    raise AssertionError("not free")


def _intervals(free: FreeIntervals) -> list[list[float]]:
    return [[a, b] for starts, ends in zip(free.starts, free.ends) for a, b in zip(starts, ends)]


@pytest.mark.parametrize("cls", [FreeIntervals, _SmallBlocks])
@pytest.mark.parametrize("seed", range(6))
def test_first_fit_and_occupy_match_a_plain_interval_list(cls, seed):
    rng = random.Random(seed)
    busy, t = [], 0.0
    for _ in range(rng.randint(1, 60)):
        t += rng.choice([0.0, rng.uniform(0.5, 30.0)])
        busy.append((t, t + rng.uniform(0.5, 20.0)))
        t = busy[-1][1]
    free = cls.complement(busy, 0.0, t + 50.0)
    reference = [[a, b] for a, b in _intervals(free)]
    copies = []
    for step in range(400):
        at, duration = rng.uniform(-5.0, t + 60.0), rng.choice([0.3, 1.0, 4.0, 12.0, 40.0])
        limit = rng.choice([float("inf"), at + rng.uniform(0.0, 80.0)])
        fit = free.earliest_fit(at, duration, limit)
        assert fit == _reference_fit(reference, at, duration, limit), (step, at, duration, limit)
        # take the kernel, part of it, up to the interval's end, or the whole interval
        if fit is not None:
            start, lo, hi = fit
            middle = (start + duration / 4, start + duration / 2)  # splits the interval
            start, end = rng.choice(
                [(start, start + duration), middle, middle, (start, hi), (lo, hi)]
            )
            free.occupy(start, end)
            _reference_occupy(reference, start, end)
        assert _intervals(free) == reference
        if step % 50 == 0:
            copies.append((free.copy(), [list(iv) for iv in reference]))
    for copy, expected in copies:  # occupying the original never touched its copies
        assert _intervals(copy) == expected
        assert copy.total() == pytest.approx(sum(b - a for a, b in expected))


def test_an_interval_empty_in_floating_point_splits_no_gap():
    """A kernel shorter than the times' spacing (1e302 us + 1 us == 1e302 us) holds nothing: its
    two sides stay one gap, which a kernel can fill across."""
    t = 1e302
    assert t + 1.0 == t
    free = FreeIntervals.complement([(t, t + 1.0)], 0.0, 2 * t)
    assert free.earliest_fit(0.0, 1.5 * t, 2 * t) == (0.0, 0.0, 2 * t)
    assert FreeIntervals.complement([(1.0, 1.0), (2.0, 3.0)], 0.0, 4.0).earliest_fit(
        0.0, 1.5, 4.0
    ) == (0.0, 0.0, 2.0)
