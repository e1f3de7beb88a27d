"""L1's free space: each segment's free extents, and which segments may hold an object of
a given size, so a full L1 finds room in time independent of its segment count.

A full L1 of N segments used to try every segment's free list before each eviction: at
512 segments (512 GiB in 1 GiB segments) planning a 128-chunk store took 11 ms; each
segment's leftover smaller than a chunk keeps it from ever being skipped for free.
`FreeSpace` remembers, per object size asked for, the segments that may still fit one:
a segment drops out when it cannot, and comes back when something in it is freed.
Not thread-safe: L1 calls it under its lock.
"""

from __future__ import annotations

import bisect

#: object sizes whose candidate segments are remembered (the distinct chunk sizes of the
#: registered layouts: a few); past this many the least recently asked is forgotten
MAX_SIZES = 64


class FreeList:
    """First-fit free extents of one segment, coalesced on free."""

    def __init__(self, size: int) -> None:
        self.starts, self.sizes = [0], [size]  # an extent of 0 bytes fits nothing

    def alloc(self, n: int) -> int | None:
        for i, size in enumerate(self.sizes):
            if size >= n:
                start = self.starts[i]
                if size == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += n
                    self.sizes[i] -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:
            i -= 1
            self.sizes[i] += n
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, n)
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes[i + 1]
            del self.starts[i + 1], self.sizes[i + 1]


class FreeSpace:
    """The free extents of L1's segments, by segment index (0, 1, ... in order added).

    A retired segment (a shrink gives it back) takes no new object and gets no freed
    extent back. `alloc(n)` tries the segments that may fit `n` bytes, most recently
    freed into (or added) first, else in order, and forgets each that cannot until
    something in it is freed.
    """

    def __init__(self) -> None:
        self._lists: list[FreeList] = []
        self._retired: set[int] = set()
        #: size -> segments that may fit it (a dict as an ordered set: last added tried first)
        self._may_fit: dict[int, dict[int, None]] = {}

    def __len__(self) -> int:
        return len(self._lists)

    def add(self, size: int) -> int:
        """A new segment of `size` free bytes; returns its index."""
        seg = len(self._lists)
        self._lists.append(FreeList(size))
        for segs in self._may_fit.values():
            segs[seg] = None
        return seg

    def alloc(self, n: int) -> tuple[int, int] | None:
        """(segment, offset) of `n` free bytes, or None when no segment has them."""
        segs = self._may_fit.pop(n, None)
        if segs is None:  # a size not asked for lately: every live segment may fit it,
            # the first segment tried first (a shrink retires the last ones)
            live = (s for s in reversed(range(len(self._lists))) if s not in self._retired)
            segs = dict.fromkeys(live)
            if len(self._may_fit) >= MAX_SIZES:
                del self._may_fit[next(iter(self._may_fit))]
        self._may_fit[n] = segs  # most recently asked last
        while segs:
            seg = next(reversed(segs))
            offset = self._lists[seg].alloc(n)
            if offset is not None:
                return seg, offset
            del segs[seg]
        return None

    def alloc_in(self, seg: int, n: int) -> int | None:
        """Offset of `n` free bytes in segment `seg`, or None."""
        return self._lists[seg].alloc(n)

    def free(self, seg: int, start: int, n: int) -> None:
        """Give `n` bytes at `start` of segment `seg` back (ignored for a retired one)."""
        if seg in self._retired:
            return
        self._lists[seg].free(start, n)
        for segs in self._may_fit.values():
            segs.pop(seg, None)
            segs[seg] = None  # tried first

    def retire(self, seg: int) -> None:
        """Segment `seg` takes no new object from now on, nor gets freed bytes back."""
        self._retired.add(seg)
        self._lists[seg] = FreeList(0)
        for segs in self._may_fit.values():
            segs.pop(seg, None)

    def clear(self) -> None:
        self._lists.clear()
        self._retired.clear()
        self._may_fit.clear()
