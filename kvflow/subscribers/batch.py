"""Per-batch counter sums and cached label sets, shared by the metric recorders.

The hot path of a metrics subscriber adds each increment to a dict keyed by
(instrument, label set) and calls `instrument.add` once per key at the end of
the batch; label dicts are cached so that one label set is one dict object.
"""

from __future__ import annotations

from typing import Any

#: A batch's pending counter adds: (instrument, id(labels)) -> [labels, amount].
Adds = dict[tuple[Any, int], list[Any]]


def add(adds: Adds, instrument: Any, labels: dict[str, str], n: int) -> None:
    """Sum an increment into the batch's pending adds, keyed by instrument and label set."""
    entry = adds.get((instrument, id(labels)))
    if entry is None:
        adds[(instrument, id(labels))] = [labels, n]
    else:
        entry[1] += n


def flush(adds: Adds) -> None:
    """Add every pending sum once (zeros too: a gauge back at 0 must still be exported)."""
    for (instrument, _), (labels, amount) in adds.items():
        instrument.add(amount, labels)


class LabelSets:
    """One cached attribute dict per label set, so `add` can key on its id."""

    __slots__ = ("_sets",)

    def __init__(self) -> None:
        self._sets: dict[tuple[Any, ...], dict[str, str]] = {}

    def get(self, names: tuple[str, ...], *values: Any) -> dict[str, str]:
        """The cached attribute dict for `names` = `values` (values rendered with str)."""
        key = (names, *values)
        labels = self._sets.get(key)
        if labels is None:
            labels = self._sets[key] = {k: str(v) for k, v in zip(names, values, strict=True)}
        return labels
