"""Sorted, disjoint free intervals of one GPU's stream, with first-fit placement."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator


class FreeIntervals:
    """Disjoint [start, end) intervals in time order.

    An LLM stage has about ten thousand bubbles and each kernel placed inside one splits it. They
    are kept in blocks of up to ``2 * BLOCK``, so that a split moves one block's entries rather than
    all of them, while a copy is still a few list copies.
    """

    BLOCK = 1024

    def __init__(self, intervals: list[tuple[float, float]]):
        merged = [(a, b) for a, b in intervals if b > a]
        self.starts = [
            [a for a, _ in merged[i : i + self.BLOCK]] for i in range(0, len(merged), self.BLOCK)
        ]
        self.ends = [
            [b for _, b in merged[i : i + self.BLOCK]] for i in range(0, len(merged), self.BLOCK)
        ]
        self.first_starts = [starts[0] for starts in self.starts]  # per block, to find it by time
        self.last_ends = [ends[-1] for ends in self.ends]

    @classmethod
    def complement(cls, busy: list[tuple[float, float]], lo: float, hi: float) -> FreeIntervals:
        """The gaps of time-ordered ``busy`` intervals inside [lo, hi). An interval empty in
        floating point (a kernel shorter than the times' spacing) splits no gap: the two halves
        would touch, and a kernel could fit across them in one copy and not in another."""
        gaps, t = [], lo
        for a, b in busy:
            if b <= a:
                continue
            if a > t:
                gaps.append((t, min(a, hi)))
            t = max(t, b)
            if t >= hi:
                break
        if t < hi:
            gaps.append((t, hi))
        return cls(gaps)

    def copy(self) -> FreeIntervals:
        new = FreeIntervals([])
        new.starts, new.ends = [list(s) for s in self.starts], [list(e) for e in self.ends]
        new.first_starts, new.last_ends = list(self.first_starts), list(self.last_ends)
        return new

    def earliest_fit(
        self, t: float, duration: float, limit: float
    ) -> tuple[float, float, float] | None:
        """Earliest start >= t of a [start, start + duration) inside one free interval, ending by
        ``limit``:
        (start, and the free interval's bounds), or None."""
        block = bisect_right(self.last_ends, t)
        if block == len(self.starts):
            return None
        starts, ends = self.starts[block], self.ends[block]
        # the interval that holds or follows t: the only one where t can be the start
        i = bisect_right(ends, t)
        start = starts[i] if starts[i] > t else t
        end = start + duration
        if end > limit:
            return None
        if end <= ends[i]:
            return start, starts[i], ends[i]
        i += 1
        while True:  # later intervals start after t
            for j in range(i, len(starts)):
                start = starts[j]
                end = start + duration
                if end > limit:
                    return None
                if end <= ends[j]:
                    return start, start, ends[j]
            block += 1
            if block == len(self.starts):
                return None
            starts, ends, i = self.starts[block], self.ends[block], 0

    def occupy(self, start: float, end: float) -> None:
        """Remove [start, end), which must lie inside one free interval."""
        block = bisect_right(self.first_starts, start) - 1
        starts, ends = self.starts[block], self.ends[block]
        i = bisect_right(starts, start) - 1
        a, b = starts[i], ends[i]
        assert a <= start and end <= b + 1e-9, (a, b, start, end)
        if start > a and b > end:  # a gap on either side: split the interval
            ends[i] = start
            starts.insert(i + 1, end)
            ends.insert(i + 1, b)
            if len(starts) > 2 * self.BLOCK:
                half = len(starts) // 2
                self.starts[block : block + 1] = [starts[:half], starts[half:]]
                self.ends[block : block + 1] = [ends[:half], ends[half:]]
                self.first_starts[block : block + 1] = [starts[0], starts[half]]
                self.last_ends[block : block + 1] = [ends[half - 1], ends[-1]]
                return
        elif start > a:
            ends[i] = start
        elif b > end:
            starts[i] = end
        else:
            del starts[i], ends[i]
            if not starts:
                del (
                    self.starts[block],
                    self.ends[block],
                    self.first_starts[block],
                    self.last_ends[block],
                )
                return
        self.first_starts[block], self.last_ends[block] = starts[0], ends[-1]

    def intervals(self) -> Iterator[tuple[float, float]]:
        for starts, ends in zip(self.starts, self.ends):
            yield from zip(starts, ends)

    def total(self) -> float:
        return sum(b - a for a, b in self.intervals())
