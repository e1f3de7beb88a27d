"""Sampled lifecycle of engine GPU blocks (docs/METRICS.md, L0 lifecycle).

Each batch decides sampling for every allocated block id at once with the
vectorised deterministic sampler (one numpy call per instance per batch), so
unsampled blocks cost a few array operations and never touch Python state;
only sampled blocks hold state, so memory follows the sample, not the id space.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, NoOpMeter, Observation

from kvflow.events import Event, EventType, Sampler
from kvflow.subscribers.batch import FOLDED_VALUE, MAX_LABEL_VALUES, LabelSets
from kvflow.subscribers.buckets import BLOCK_SECONDS
from kvflow.subscribers.preaggregated import HistogramStore
from kvflow.subscribers.providers import KvflowMeterProvider

_ALLOC = EventType.BLOCK_ALLOCATION
_END_SESSION = EventType.END_SESSION
_UNREGISTER = EventType.UNREGISTER
_IM = ("instance_id", "model_name")
_NS = 1e-9
#: records one histogram value for a label set (SDK instrument or pre-aggregated store)
_Record = Callable[[float, Mapping[str, str]], None]
#: adds to one counter for a label set
_Add = Callable[[int, Mapping[str, str]], None]


class _Block:
    """One sampled block. `owners` is a request id, a set of them, or None once released."""

    __slots__ = ("alloc_ns", "history", "owners", "release_ns", "tokens")

    def __init__(self, tokens: int, owner: str, ts: int) -> None:
        self.tokens = tokens
        self.owners: str | set[str] | None = owner
        self.alloc_ns = ts
        self.release_ns = 0
        self.history = [ts]


class _Alloc:
    """A validated BLOCK_ALLOCATION event, ready for the in-order state pass."""

    __slots__ = ("block_size", "instance_id", "labels", "records", "ts")

    def __init__(
        self,
        ts: int,
        instance_id: str,
        labels: dict[str, str],
        block_size: int,
        records: list[tuple[str, Sequence[int], Sequence[int]]],
    ) -> None:
        self.ts = ts
        self.instance_id = instance_id
        self.labels = labels
        self.block_size = block_size
        self.records = records


def _histogram_store(meter_provider: MeterProvider, meter: Meter) -> HistogramStore | None:
    """A store for pre-aggregated histograms on kvflow's provider (an SDK record costs
    ~10 us), registered as its producer; None for a plain provider (or a disabled SDK's
    no-op meter), which gets SDK instruments."""
    if isinstance(meter_provider, KvflowMeterProvider) and not isinstance(meter, NoOpMeter):
        store = HistogramStore("kvflow.l0")
        meter_provider.add_producer(store)
        return store
    return None


def _block_age_histograms(
    meter: Meter, store: HistogramStore | None
) -> tuple[_Record, _Record, _Record]:
    """The record functions of block lifetime, idle before evict and reuse gap (seconds),
    in `store` when there is one, else SDK histograms of `meter`."""

    def histogram(name: str, description: str) -> _Record:
        """One histogram's record function."""
        if store is not None:
            return store.histogram(
                name, unit="s", description=description, boundaries=BLOCK_SECONDS
            ).record
        return meter.create_histogram(
            name,
            unit="s",
            description=description,
            explicit_bucket_boundaries_advisory=BLOCK_SECONDS,
        ).record

    return (
        histogram("kvflow.l0.block_lifetime", "Sampled GPU block: allocation to eviction"),
        histogram(
            "kvflow.l0.block_idle_before_evict",
            "Sampled GPU block: release by its last owner to eviction",
        ),
        histogram(
            "kvflow.l0.block_reuse_gap", "Sampled GPU block: time between consecutive accesses"
        ),
    )


def _record_counters(meter: Meter) -> tuple[_Add, _Add, _Add]:
    """The add functions of the allocation record, allocated block and invalid record
    counters."""
    records = meter.create_counter(
        "kvflow.l0.allocation_records",
        unit="{record}",
        description="BlockAllocation records reported by the engine",
    )
    blocks = meter.create_counter(
        "kvflow.l0.allocated_blocks",
        unit="{block}",
        description="Blocks allocated by the engine (all of them, sampled or not)",
    )
    invalid = meter.create_counter(
        "kvflow.l0.invalid_records",
        unit="{record}",
        description="Allocation records skipped as malformed",
    )
    return records.add, blocks.add, invalid.add


class L0LifecycleSubscriber:
    """Tracks sampled (instance_id, block_id) pairs through ACTIVE/RELEASED/evicted.

    Emits `kvflow.l0.block_lifetime`, `kvflow.l0.block_idle_before_evict` and
    `kvflow.l0.block_reuse_gap` (seconds) on eviction, and counts every
    allocation record and block, sampled or not. `max_history` bounds the access
    history of a hot block: when reached, its gaps so far are recorded early.
    With kvflow's provider (`make_meter_provider`) the histograms are
    pre-aggregated in a `HistogramStore`; any other provider gets SDK instruments.
    Both export the same data. Label values (instance_id, model_name) are bounded
    like MetricsSubscriber's: at most `max_label_values` distinct values per label,
    later new ones fold into "other" (kvflow.l0.folded_labels); an unregistered
    instance leaves kvflow.l0.tracked_blocks at once.
    """

    name = "l0_lifecycle"
    #: in-memory aggregation only (exporters read on their own threads): run inline on the bus
    blocking = False
    event_types: frozenset[EventType] | None = frozenset({_ALLOC, _END_SESSION, _UNREGISTER})

    def __init__(
        self,
        meter_provider: MeterProvider,
        sample_rate: float = 0.01,
        seed: int = 0,
        *,
        max_history: int = 256,
        max_label_values: int = MAX_LABEL_VALUES,
    ) -> None:
        if not isinstance(max_history, int) or max_history < 2:
            raise ValueError(f"max_history must be an integer >= 2, got {max_history!r}")
        self._sampler = Sampler(sample_rate, seed)
        self._max_history = max_history
        self._blocks: dict[str, dict[int, _Block]] = {}
        self._owned: dict[str, list[_Block]] = {}
        self._labels = LabelSets(max_label_values)
        self._instance_labels: dict[str, dict[str, str]] = {}
        meter = meter_provider.get_meter("kvflow.l0")
        self._store = _histogram_store(meter_provider, meter)
        self._lifetime, self._idle, self._reuse_gap = _block_age_histograms(meter, self._store)
        self._records_counter, self._blocks_counter, self._invalid_counter = _record_counters(meter)
        meter.create_observable_gauge(
            "kvflow.l0.tracked_blocks",
            callbacks=[self._observe_tracked],
            unit="{block}",
            description="Sampled blocks currently held in lifecycle state",
        )
        meter.create_observable_counter(
            "kvflow.l0.folded_labels",
            callbacks=[self._observe_folded],
            unit="{label_set}",
            description=(
                f"L0 label sets recorded with a client-chosen value folded into {FOLDED_VALUE!r} "
                f"(beyond {max_label_values} distinct values of the label)"
            ),
        )

    # -- introspection -------------------------------------------------------------

    @property
    def sample_rate(self) -> float:
        return self._sampler.rate

    @property
    def histogram_store(self) -> HistogramStore | None:
        """The pre-aggregated block-age histograms (None on a provider other than kvflow's).

        Read-only use: the engine's status summarises them (`kvflow top`, `kvflow report`)
        without a metric reader of its own.
        """
        return self._store

    def tracked_block_ids(self, instance_id: str) -> frozenset[int]:
        """The sampled block ids of `instance_id` that currently hold state."""
        return frozenset(int(b) for b in self._blocks.get(instance_id, {}))

    def _observe_tracked(self, options: CallbackOptions) -> Iterable[Observation]:
        # instances folded into one label set are summed (one observation per set)
        sums: dict[int, list[Any]] = {}
        for instance_id, blocks in list(self._blocks.items()):
            labels = self._instance_labels.get(instance_id)
            if labels is not None:
                entry = sums.setdefault(id(labels), [labels, 0])
                entry[1] += len(blocks)
        return [Observation(n, labels) for labels, n in sums.values()]

    def _observe_folded(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"label": name}) for name, n in self._labels.folded.items()]

    # -- event processing --------------------------------------------------------------

    def on_events(self, events: Sequence[Event]) -> None:
        """Sample every allocated block of the batch at once, then run the state machine."""
        steps, ids_by_instance, counts = self._validate(events)
        kept = self._sample(ids_by_instance)
        cursors = dict.fromkeys(kept, 0)
        offsets = dict.fromkeys(kept, 0)
        for step in steps:
            if type(step) is _Alloc:
                inst = step.instance_id
                positions = kept[inst]
                cursor = cursors[inst]
                offset = offsets[inst]
                n_kept = len(positions)
                for record in step.records:
                    end = offset + len(record[1])
                    if cursor < n_kept and positions[cursor] < end:
                        first = cursor
                        while cursor < n_kept and positions[cursor] < end:
                            cursor += 1
                        self._allocate(step, record, [p - offset for p in positions[first:cursor]])
                    offset = end
                cursors[inst] = cursor
                offsets[inst] = offset
            elif step.type is _END_SESSION:
                if step.session_id is not None:
                    self._end_session(step.session_id, step.ts_ns)
            else:
                self._unregister(step)
        for key, (n_records, n_blocks, n_invalid) in counts.items():
            labels = self._label_set(*key)
            if n_records:
                self._records_counter(n_records, labels)
                self._blocks_counter(n_blocks, labels)
            if n_invalid:
                self._invalid_counter(n_invalid, labels)

    def _label_set(self, instance_id: str, model_name: str) -> dict[str, str]:
        return self._labels.get(_IM, instance_id, model_name)

    def _validate(
        self, events: Sequence[Event]
    ) -> tuple[list[Any], dict[str, list[Sequence[int]]], dict[tuple[str, str], list[int]]]:
        """Pass 1: keep well-formed records in order, gather block ids per instance."""
        steps: list[Any] = []
        ids_by_instance: dict[str, list[Sequence[int]]] = {}
        counts: dict[tuple[str, str], list[int]] = {}
        for ev in events:
            etype = ev.type
            if etype is not _ALLOC:
                steps.append(ev)
                continue
            attrs = ev.attrs
            instance_id = attrs.get("instance_id")
            model_name = attrs.get("model_name")
            block_size = attrs.get("block_size")
            records = attrs.get("records")
            key = (str(instance_id), str(model_name))
            tally = counts.get(key)
            if tally is None:
                tally = counts[key] = [0, 0, 0]
            if (
                not isinstance(instance_id, str)
                or type(block_size) is not int
                or block_size < 1
                or not isinstance(records, Sequence)
            ):
                tally[2] += len(records) if isinstance(records, Sequence) else 1
                continue
            good = []
            seqs = ids_by_instance.setdefault(instance_id, [])
            for record in records:
                try:
                    req_id, block_ids, token_ids = record
                    n = len(block_ids)
                    valid = isinstance(req_id, str) and len(token_ids) <= n * block_size
                except (TypeError, ValueError):
                    valid = False
                if valid:
                    good.append(record)
                    seqs.append(block_ids)
                    tally[1] += n
                else:
                    tally[2] += 1
            tally[0] += len(good)
            if good:
                labels = self._label_set(*key)
                self._instance_labels[instance_id] = labels
                steps.append(_Alloc(ev.ts_ns, instance_id, labels, block_size, good))
        return steps, ids_by_instance, counts

    def _sample(self, ids_by_instance: dict[str, list[Sequence[int]]]) -> dict[str, list[int]]:
        """Positions (in batch order) of the sampled block ids, per instance."""
        keep_mask = self._sampler.keep_mask
        kept: dict[str, list[int]] = {}
        for instance_id, seqs in ids_by_instance.items():
            total = sum(map(len, seqs))
            ids = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=total)
            kept[instance_id] = np.flatnonzero(keep_mask(instance_id, ids=ids)).tolist()
        return kept

    def _allocate(
        self, step: _Alloc, record: tuple[str, Sequence[int], Sequence[int]], js: list[int]
    ) -> None:
        """L0 lifecycle rules 1-5 (docs/METRICS.md) for the sampled blocks `js` of one record."""
        req, block_ids, token_ids = record
        ts = step.ts
        bs = step.block_size
        blocks = self._blocks.get(step.instance_id)
        if blocks is None:
            blocks = self._blocks[step.instance_id] = {}
        owned = self._owned.get(req) or []
        for j in js:
            block_id = int(block_ids[j])
            tokens = hash(tuple(token_ids[j * bs : (j + 1) * bs]))
            blk = blocks.get(block_id)
            if blk is None:  # 1. unseen -> ACTIVE
                blk = blocks[block_id] = _Block(tokens, req, ts)
                owned.append(blk)
                continue
            owners = blk.owners
            if blk.tokens == tokens:
                if owners is None:  # 4. reuse of a released block
                    history = blk.history
                    if len(history) >= self._max_history:
                        self._record_gaps(history, step.labels)
                        del history[:-1]
                    history.append(ts)
                    blk.owners = req
                    owned.append(blk)
                elif owners == req or (type(owners) is set and req in owners):
                    pass  # 2. same tokens, same request
                else:  # 3. prefix sharing: co-owner
                    blk.owners = {owners, req} if isinstance(owners, str) else owners | {req}
                    owned.append(blk)
                continue
            # 5. different tokens: the engine evicted the block and reused its id
            self._evict(blk, ts, step.labels)
            blk.tokens = tokens
            blk.owners = req
            blk.alloc_ns = ts
            blk.release_ns = 0
            blk.history = [ts]
            owned.append(blk)
        if owned:  # (re)attach: evicting the request's own block may have detached it
            self._owned[req] = owned

    def _evict(self, blk: _Block, ts: int, labels: dict[str, str]) -> None:
        self._lifetime(max(ts - blk.alloc_ns, 0) * _NS, labels)
        owners = blk.owners
        if owners is None:
            self._idle(max(ts - blk.release_ns, 0) * _NS, labels)
        else:
            for owner in (owners,) if type(owners) is str else owners:
                self._disown(owner, blk)
        self._record_gaps(blk.history, labels)

    def _record_gaps(self, history: list[int], labels: dict[str, str]) -> None:
        record = self._reuse_gap
        for i in range(1, len(history)):
            record(max(history[i] - history[i - 1], 0) * _NS, labels)

    def _disown(self, owner: str, blk: _Block) -> None:
        """Drop `blk` from an owner's list when the block is evicted while ACTIVE."""
        owned = self._owned.get(owner)
        if owned is not None:
            owned.remove(blk)
            if not owned:
                del self._owned[owner]

    def _end_session(self, req: str, ts: int) -> None:
        """6. The request leaves every block it owned; ownerless blocks become RELEASED."""
        for blk in self._owned.pop(req, ()):
            owners = blk.owners
            if owners == req:
                blk.owners = None
                blk.release_ns = ts
            elif type(owners) is set and req in owners:
                owners.discard(req)
                if len(owners) == 1:
                    blk.owners = next(iter(owners))

    def _unregister(self, ev: Event) -> None:
        """Forget an unregistered instance's blocks (its block ids mean nothing any more)."""
        instance_id = ev.attrs.get("instance_id")
        if isinstance(instance_id, str):
            self._blocks.pop(instance_id, None)
            self._instance_labels.pop(instance_id, None)

    def shutdown(self) -> None:
        """Drop all state; nothing is pending (observations are recorded as they happen)."""
        self._blocks.clear()
        self._owned.clear()
