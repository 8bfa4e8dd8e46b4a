"""The median of a changing multiset of numbers, with one member left out, pure.

The monitor judges each machine's report against the rest of the job (its step against
the others' steps, its compute time against the others' median times). Recomputing
that median over every machine for every report costs O(n log n) a report, O(n² log n)
a step of the whole job: at 512 machines half a core. Kept sorted, a report moves one
value (a bisect and a memmove) and reads the median by index.
"""

from __future__ import annotations

import bisect


class SortedMedian:
    """A sorted multiset of floats; `median(excluding=v)` is that of the set less one v."""

    def __init__(self) -> None:
        self._values: list[float] = []

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        bisect.insort(self._values, value)

    def remove(self, value: float) -> None:
        """Drops one copy of `value`, which must be a member (KeyError otherwise)."""
        i = bisect.bisect_left(self._values, value)
        if i == len(self._values) or self._values[i] != value:
            raise KeyError(value)
        del self._values[i]

    def replace(self, old: float | None, new: float) -> None:
        """`new` in place of `old` (None: `new` is added)."""
        if old is not None:
            self.remove(old)
        self.add(new)

    def median(self, excluding: float | None = None) -> float | None:
        """As `statistics.median` of the members less one copy of `excluding` (which must
        be a member when given); None when that leaves none."""
        values = self._values
        skip = len(values)  # index of the member left out; none by default
        if excluding is not None:
            skip = bisect.bisect_left(values, excluding)
            if skip == len(values) or values[skip] != excluding:
                raise KeyError(excluding)
        n = len(values) - (excluding is not None)
        if n <= 0:
            return None

        def at(j: int) -> float:
            return values[j if j < skip else j + 1]

        if n % 2:
            return at(n // 2)
        return (at(n // 2 - 1) + at(n // 2)) / 2
