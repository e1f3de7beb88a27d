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


#: Distinct values each client-chosen label keeps; later new values are folded into
#: FOLDED_VALUE (docs/METRICS.md, "Label bounds").
MAX_LABEL_VALUES = 256
#: The value that stands for every client-chosen value beyond MAX_LABEL_VALUES.
FOLDED_VALUE = "other"
#: Labels whose values clients choose; every other label is one of kvflow's own
#: small vocabularies (operation, outcome, tier, ...).
CLIENT_LABELS = ("model_name", "instance_id")


class LabelSets:
    """One cached attribute dict per label set, so `add` can key on its id.

    The values of CLIENT_LABELS are bounded: the first `max_values` distinct values
    of each are kept for the subscriber's life (a cumulative series never goes away,
    so a freed slot would only let the series grow again); a later new value becomes
    FOLDED_VALUE and counts in `folded[label]`. The cache is bounded with them.
    """

    __slots__ = ("_max", "_seen", "_sets", "folded")

    def __init__(self, max_values: int = MAX_LABEL_VALUES) -> None:
        if isinstance(max_values, bool) or not isinstance(max_values, int) or max_values < 1:
            raise ValueError(f"max_values must be an integer >= 1, got {max_values!r}")
        self._max = max_values
        self._sets: dict[tuple[Any, ...], dict[str, str]] = {}
        self._seen: dict[str, set[str]] = {name: set() for name in CLIENT_LABELS}
        #: label name -> label sets built with a value folded into FOLDED_VALUE
        self.folded: dict[str, int] = dict.fromkeys(CLIENT_LABELS, 0)

    def get(self, names: tuple[str, ...], *values: Any) -> dict[str, str]:
        """The cached attribute dict for `names` = `values` (values rendered with str,
        client-chosen ones folded beyond the bound)."""
        key = (names, *values)
        labels = self._sets.get(key)
        if labels is not None:
            return labels
        rendered = [self.fold(k, v) for k, v in zip(names, values, strict=True)]
        folded_key = (names, *rendered)
        labels = self._sets.get(folded_key)
        if labels is None:
            labels = self._sets[folded_key] = dict(zip(names, rendered, strict=True))
        if all(str(v) == r for v, r in zip(values, rendered, strict=True)):
            self._sets[key] = labels  # nothing folded: the raw values are bounded too
        return labels

    def fold(self, name: str, value: Any) -> str:
        """`value` as a label value of `name`: str(value), or FOLDED_VALUE for a new
        client-chosen value beyond the bound (counted in `folded`)."""
        text = str(value)
        seen = self._seen.get(name)
        if seen is None or text in seen:
            return text
        if len(seen) < self._max:
            seen.add(text)
            return text
        self.folded[name] += 1
        return FOLDED_VALUE
