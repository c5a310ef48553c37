"""Sorted, disjoint free intervals of one GPU's stream, with first-fit placement."""

from __future__ import annotations

from bisect import bisect_right


class FreeIntervals:
    """Disjoint [start, end) intervals in time order."""

    def __init__(self, intervals: list[tuple[float, float]]):
        merged = [(a, b) for a, b in intervals if b > a]
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    @classmethod
    def complement(cls, busy: list[tuple[float, float]], lo: float, hi: float) -> FreeIntervals:
        """The gaps of time-ordered ``busy`` intervals inside [lo, hi)."""
        gaps, t = [], lo
        for a, b in busy:
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
        new.starts, new.ends = list(self.starts), list(self.ends)
        return new

    def earliest_fit(self, t: float, duration: float, limit: float) -> tuple[float, float, float] | None:
        """Earliest start >= t of a [start, start + duration) inside one free interval, ending by ``limit``:
        (start, and the free interval's bounds), or None."""
        starts, ends = self.starts, self.ends
        i = bisect_right(ends, t)
        if i < len(starts):  # the interval that holds or follows t: the only one where t can be the start
            start = starts[i] if starts[i] > t else t
            if start + duration > limit:
                return None
            if start + duration <= ends[i]:
                return start, starts[i], ends[i]
            i += 1
        for i in range(i, len(starts)):  # later intervals start after t
            start = starts[i]
            if start + duration > limit:
                return None
            if start + duration <= ends[i]:
                return start, start, ends[i]
        return None

    def occupy(self, start: float, end: float) -> None:
        """Remove [start, end), which must lie inside one free interval."""
        starts, ends = self.starts, self.ends
        i = bisect_right(starts, start) - 1
        a, b = starts[i], ends[i]
        assert a <= start and end <= b + 1e-9, (a, b, start, end)
        if start > a and b > end:  # a gap on either side: split the interval
            ends[i] = start
            starts.insert(i + 1, end)
            ends.insert(i + 1, b)
        elif start > a:
            ends[i] = start
        elif b > end:
            starts[i] = end
        else:
            del starts[i], ends[i]

    def total(self) -> float:
        return sum(b - a for a, b in zip(self.starts, self.ends))
