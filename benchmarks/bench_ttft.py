"""Time to first token with a real transformer: recompute vs a prefix retrieved from kvflow.

For each model shape and prompt length, in one run on one device:
  (a) recompute   full prefill of the prompt (what happens without a KV cache)
  (b) kvflow      retrieve the prompt's cached prefix from a `kvflow server` subprocess
                  into a paged cache (CUDA IPC on a GPU, shared memory on the CPU),
                  then prefill only the rest (the last partial chunk)
  (c) copy        the same prefix bytes moved by one pinned host-to-device copy
  (d) suffix      the prefill of (b) with the prefix's KV already in the paged cache
so (c) + (d) is the floor for (b). Every prefill reads a layer's KV from the paged
cache as the forward's attention reaches that layer (after its projections, where vLLM's
attention waits for a layerwise load), so (b), (d) and (e) run one and the same forward. Medians of --repeat runs, (b) and (d) alternating;
kvflow's part, (b) - (d), is the median of each back-to-back pair's difference. The logits of (b)
must equal those of (d) exactly (the retrieved KV is bit-exact) and those of (a)
within bf16 tolerance; a failed check exits 1. Prints a table; `--json` keeps
the rows, `--plot ROWS.json --png OUT.png` draws TTFT against prompt length.

Models are Llama-architecture from a config with random weights (no download):
1b = 16 layers, 2048 hidden, 8 KV heads x 64; 8b = 32 layers, 4096 hidden,
8 KV heads x 128; toy = a few MB, for the CPU path in CI.

    python benchmarks/bench_ttft.py --models 1b,8b --lengths 2048,8192,32768
    python benchmarks/bench_ttft.py --device cpu --models toy --lengths 512,1024
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CHUNK = 256
BLOCK = 16
#: relative error of (b)'s last logits against a full recompute, in bf16
BF16_TOLERANCE = 0.05


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model's size."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


SHAPES = {
    "toy": Shape(2, 128, 4, 2, 32, 256, 512),
    "1b": Shape(16, 2048, 32, 8, 64, 8192, 32000),
    "8b": Shape(32, 4096, 32, 8, 128, 14336, 128256),
}


@dataclass
class Row:
    """One (model, prompt length) result; times in milliseconds (medians)."""

    model: str
    prompt: int
    prefix: int
    suffix: int
    prefix_gib: float
    recompute_ms: float
    kvflow_ms: float
    copy_ms: float
    suffix_ms: float
    #: median over repetitions of (b) - (d), each pair timed back to back: kvflow's part
    #: of the TTFT, steadier than the difference of the two medians (the suffix prefill
    #: alone drifts by 10-20 ms between runs)
    added_ms: float
    retrieve_ms: float  # the client's retrieve call (a CUDA retrieve returns once queued)
    retrieve_server_ms: float  # of which the server's own handling (receipt to reply)
    landed_ms: float  # call start to the copies landed on the GPU (CUDA; else the call)
    logits_rel_err: float
    #: (e) a layerwise retrieve (returns once sent) + the suffix prefill, each layer
    #: waiting for its own copies (0 when not run)
    layerwise_ms: float = 0.0
    #: one layer's share of (c): what the copy of the last layer adds to the floor of (e)
    layer_copy_ms: float = 0.0
    #: (e)'s parts (medians over repetitions): the layerwise call until it returned (the
    #: request sent), the engine's wait on layer 0 (its mark, then its copies), and its
    #: waits on every later layer together (host wait for the layer's mark plus the
    #: stream's stall at its event: LayerwiseLoad.layer_waits)
    layerwise_call_ms: float = 0.0
    first_wait_ms: float = 0.0
    later_waits_ms: float = 0.0
    #: where the prompt's blocks were in the cache: "shuffled" or "in-order" (--blocks)
    blocks: str = "shuffled"
    #: layers of each timed (e) the server staged in the engine's ring and the engine
    #: scattered (--staging-slots; 0 without a ring): the median over repetitions
    staged_layers: int = 0
    #: median over repetitions of (e) / (max((c), (d)) + one layer's copy) with the (d)
    #: timed right before that (e): steadier than the ratio of medians, since the suffix
    #: prefill drifts by 10 ms and more between runs (0 when (e) was not run)
    paired_over_floor: float = 0.0
    #: (e)'s host time inside its layer waits (LayerwiseLoad.host_s: the reply, the
    #: flags, the ring's scatters), which a host-bound forward pays in full, and the
    #: scatters of the ring (one a slot use): medians over repetitions
    wait_host_ms: float = 0.0
    ring_scatters: int = 0
    #: the host time of each layer's wait (LayerwiseLoad.host_by_layer), by layer: medians
    #: over repetitions
    wait_host_by_layer_ms: list[float] = field(default_factory=list)
    #: every repetition's (d), (e) and (e)'s host time in waits, in the order timed (each
    #: (e) right after its (d)): what a pair's overhead is made of, run by run
    suffix_runs_ms: list[float] = field(default_factory=list)
    layerwise_runs_ms: list[float] = field(default_factory=list)
    wait_host_runs_ms: list[float] = field(default_factory=list)

    @property
    def layerwise_ratio(self) -> float:
        """(e) / (a)."""
        return self.layerwise_ms / self.recompute_ms

    @property
    def layerwise_over_floor(self) -> float:
        """(e) / (max((c), (d)) + one layer's copy): 1.0 is a perfectly hidden copy."""
        return self.layerwise_ms / (max(self.copy_ms, self.suffix_ms) + self.layer_copy_ms)

    @property
    def ratio(self) -> float:
        """(b) / (a): the share of a recompute's TTFT that a kvflow hit costs."""
        return self.kvflow_ms / self.recompute_ms

    @property
    def over_copy(self) -> float:
        """((b) - (d)) / (c): kvflow's part of the TTFT (paired, `added_ms`) against a
        plain pinned copy."""
        return self.added_ms / self.copy_ms


def _mark(device: torch.device) -> Any:
    """A timing event recorded on the current CUDA stream (None on the CPU). Recorded
    before a retrieve on an idle stream and after it (which returns once the copies
    landed), their interval is the time until the retrieved KV landed."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def build_model(shape: Shape, dtype: torch.dtype, device: torch.device) -> Any:
    """A Llama with random weights, built directly on `device` (fast even at 8B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=65536,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class PagedCache:
    """A vLLM-flash-attention paged KV cache: per layer `[2, blocks, BLOCK, kv_heads, head_dim]`."""

    def __init__(
        self, shape: Shape, num_blocks: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        page = (num_blocks, BLOCK, shape.kv_heads, shape.head_dim)
        if device.type == "cpu":
            from kvflow.core import empty_shared

            self.layers = [empty_shared((2, *page), dtype) for _ in range(shape.layers)]
        else:
            self.layers = [torch.empty((2, *page), dtype=dtype, device=device)]
            self.layers += [torch.empty_like(self.layers[0]) for _ in range(shape.layers - 1)]
        self.num_blocks = num_blocks

    def write(self, past: Any, num_tokens: int, table: torch.Tensor) -> None:
        """Put the first `num_tokens` (a multiple of BLOCK) of a transformers cache into `table`."""
        n = num_tokens // BLOCK
        for layer, view in enumerate(self.layers):
            for side, states in enumerate((past.layers[layer].keys, past.layers[layer].values)):
                # [1, H, T, D] -> [n, BLOCK, H, D]
                pages = states[0, :, :num_tokens].transpose(0, 1).unflatten(0, (n, BLOCK))
                view[side, table.to(view.device)] = pages

    def past(self, model: Any, num_tokens: int, table: torch.Tensor) -> Any:
        """A transformers cache holding the KV of `table`'s first `num_tokens` tokens."""
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        index = table.to(self.layers[0].device)
        for layer in range(len(self.layers)):
            cache.update(*self.layer_kv(layer, num_tokens, index), layer)
        return cache

    def layer_kv(
        self, layer: int, num_tokens: int, index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of the blocks `index`, first `num_tokens`, as [1, H, T, D]."""
        kv = self.layers[layer][:, index].flatten(1, 2)[:, :num_tokens]  # [2, T, H, D]
        kv = kv.transpose(1, 2).unsqueeze(1)  # [2, 1, H, T, D]
        return kv[0], kv[1]

    def fill(self, table: torch.Tensor, value: float) -> None:
        for view in self.layers:
            view[:, table.to(view.device)] = value

    def blocks(self, table: torch.Tensor) -> list[torch.Tensor]:
        return [view[:, table.to(view.device)] for view in self.layers]


class _InPlace:
    """The load of (b) and (d): the KV is in the blocks before the forward starts."""

    def wait_layer(self, layer: int) -> None:
        """Nothing to wait for."""


IN_PLACE = _InPlace()


@functools.cache
def _layerwise_past_class() -> type:
    """transformers' DynamicCache whose layer i takes its prefix's KV from the paged cache
    when the layer's attention first writes to it: after the layer's projections and
    rotary, right before attention reads the KV, where vLLM's attention op calls the
    connector's `wait_for_layer_load` (`maybe_transfer_kv_layer`). Built once, on first
    use: transformers is imported only by the runs that need it."""
    from transformers import DynamicCache

    class LayerwisePast(DynamicCache):  # type: ignore[misc,valid-type]
        """Layer 0 holds a placeholder of the prefix's length from the start (the model
        reads that length for the positions and the mask before any layer runs); each
        layer's first update puts the prefix's KV in first, after `load.wait_layer`."""

        def __init__(
            self, model: Any, cache: PagedCache, num_tokens: int, index: torch.Tensor, load: Any
        ) -> None:
            super().__init__(config=model.config)
            self._cache, self._num_tokens, self._index, self._load = cache, num_tokens, index, load
            self._pending = set(range(len(cache.layers)))
            _, _, _, heads, head_dim = cache.layers[0].shape
            placeholder = cache.layers[0].new_empty((1, heads, num_tokens, head_dim))
            super().update(placeholder, placeholder, 0)

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
            *args: Any, **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            if layer_idx in self._pending:
                self._pending.discard(layer_idx)
                self._load.wait_layer(layer_idx)
                keys, values = self._cache.layer_kv(layer_idx, self._num_tokens, self._index)
                if layer_idx == 0:  # the placeholder goes
                    self.layers[0].keys, self.layers[0].values = keys, values
                else:
                    super().update(keys, values, layer_idx)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return LayerwisePast


def layerwise_past(
    cache: PagedCache, model: Any, num_tokens: int, table: torch.Tensor, load: Any
) -> Any:
    """A transformers cache that reads layer i's KV (the first `num_tokens` of `table`'s
    blocks) from the paged cache as the forward's attention reaches layer i, after
    `load.wait_layer(i)`: the wait the vLLM connector makes in `wait_for_layer_load`,
    at the same point of the layer (`_layerwise_past_class`)."""
    index = table.to(cache.layers[0].device)
    return _layerwise_past_class()(model, cache, num_tokens, index, load)


@contextlib.contextmanager
def kvflow_server(l1_gib: float, log: Path, *flags: str, chunk_size: int = CHUNK) -> Iterator[str]:
    """A `kvflow server` subprocess on a free port (chunks of `chunk_size` tokens, L1 of
    `l1_gib` GiB, its log in `log`, further `flags`); yields its endpoint. bench_two_gpus
    and bench_sglang_storage use it too."""
    cmd = [sys.executable, "-m", "kvflow.cli", "server", "--port", "0", "--prometheus-port", "0"]
    cmd += ["--chunk-size", str(chunk_size), "--l1-size-gb", f"{l1_gib:g}"]
    cmd += ["--log-format", "console"]
    cmd += flags
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stderr=out, stdout=out, text=True)
    try:
        deadline = time.monotonic() + 180
        # the public endpoint's line (a sharded server's shards log their ipc:// ones)
        while (found := re.search(r"listening on (tcp://\S+)", log.read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvflow server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(60)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _median_ms(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    return 1e3 * statistics.median(_seconds(fn, device) for _ in range(repeat))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """The forward keyword for a KV cache: `cache` from transformers 5.24 (which
    deprecates `past_key_values`), `past_key_values` before. Looked up once per class:
    `_last_logits` is inside the timed prefills."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _last_logits(model: Any, ids: torch.Tensor, past: Any = None) -> torch.Tensor:
    with torch.no_grad():
        kw = {_cache_keyword(type(model)): past}
        out = model(ids.unsqueeze(0), **kw, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def _copy_ms(nbytes: int, repeat: int, device: torch.device) -> float:
    """Median time of one host-to-device copy of `nbytes` from pinned memory."""
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(1)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dest.copy_(host, non_blocking=pinned)  # warm-up
    return _median_ms(lambda: dest.copy_(host, non_blocking=pinned), repeat, device)


def measure(
    client: Any,
    name: str,
    model: Any,
    cache: PagedCache,
    shape: Shape,
    length: int,
    repeat: int,
    device: torch.device,
    layerwise: bool = False,
    in_order: bool = False,
) -> Row:
    """One row: (a)-(d) for a prompt of `length` tokens, checks included (AssertionError)."""
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, shape.vocab, (length,), generator=gen)
    ids = tokens.to(device)
    prefix = (length - 1) // CHUNK * CHUNK
    n_blocks = prefix // BLOCK
    # shuffled: blocks anywhere in the cache (a long-running engine); in order: a fresh
    # engine's allocation, which a layerwise retrieve copies straight into (no kernel)
    order = (
        torch.arange(cache.num_blocks)
        if in_order
        else torch.randperm(cache.num_blocks, generator=gen)
    )
    stored_at, retrieved_at = order[:n_blocks], order[n_blocks : 2 * n_blocks]
    # the block table on the device, as an engine keeps it: uploading it inside the timed
    # prefill (a pageable copy, ordered on the stream) would hold the host until the
    # retrieved KV landed, so none of the prefill's host work could overlap the copies
    table = retrieved_at.to(device)
    instance, model_name = f"ttft-{name}", f"ttft-{name}"

    expected = _last_logits(model, ids)  # (a), once for the check
    recompute_ms = _median_ms(lambda: _last_logits(model, ids), repeat, device)
    with torch.no_grad():
        full = model(ids[:prefix].unsqueeze(0), use_cache=True, logits_to_keep=1)
    cache.write(full["cache"] if "cache" in full else full["past_key_values"], prefix, stored_at)
    del full
    _sync(device)
    stored = client.store(instance, tokens[:prefix], stored_at, request_id=f"{name}-{length}-s")
    assert stored == prefix, f"stored {stored} of {prefix} tokens"
    assert client.lookup(tokens, model_name=model_name) == prefix

    requests = iter(range(1 << 30))

    def suffix_logits(load: Any) -> torch.Tensor:
        """The suffix's prefill, each layer's KV read from the blocks after
        `load.wait_layer(layer)`."""
        return _last_logits(model, ids[prefix:], layerwise_past(cache, model, prefix, table, load))

    def with_kvflow() -> torch.Tensor:
        rid = f"{name}-{length}-r{next(requests)}"
        begin = _mark(device)
        started = time.perf_counter()
        got = client.retrieve(instance, tokens[:prefix], retrieved_at, request_id=rid)
        retrieve_s.append(time.perf_counter() - started)
        landed.append((begin, _mark(device), retrieve_s[-1]))
        server_s.append(client.last_server_time_s)
        assert got == prefix, f"retrieved {got} of {prefix} tokens"
        sessions.append(rid)
        return suffix_logits(IN_PLACE)

    def end_sessions() -> None:
        """End the timed requests' sessions, outside the timing: an engine ends a session
        when its request finishes (vLLM's connector, in the background), not before its
        first token."""
        while sessions:
            client.end_session(sessions.pop())

    sessions: list[str] = []
    retrieve_s: list[float] = []
    server_s: list[float] = []
    landed: list[tuple[Any, Any, float]] = []
    cache.fill(retrieved_at, float("nan"))  # a retrieve that wrote nothing shows as NaN logits
    got_logits = with_kvflow()
    end_sessions()
    for a, b in zip(cache.blocks(stored_at), cache.blocks(retrieved_at), strict=True):
        assert torch.equal(a, b), "retrieved blocks differ from the stored ones"
    retrieve_s.clear()
    server_s.clear()
    landed.clear()

    def suffix_only() -> torch.Tensor:
        return suffix_logits(IN_PLACE)

    layer_loads: list[tuple[float, Any]] = []  # (call seconds, load) of each (e)

    def with_layerwise() -> torch.Tensor:
        rid = f"{name}-{length}-l{next(requests)}"
        began = time.perf_counter()
        load = client.retrieve_layerwise(instance, tokens[:prefix], retrieved_at, request_id=rid)
        layer_loads.append((time.perf_counter() - began, load))
        sessions.append(rid)
        logits = suffix_logits(load)  # its waits need no reply (its last reads it)
        assert load.hit_tokens == prefix, f"layerwise retrieved {load.hit_tokens} of {prefix}"
        return logits

    floor_logits = suffix_only()
    assert torch.equal(got_logits, floor_logits), "(b) and (d) logits differ"
    if layerwise:
        cache.fill(retrieved_at, float("nan"))
        layer_logits = with_layerwise()
        end_sessions()
        assert torch.equal(layer_logits, floor_logits), "(e) and (d) logits differ"
    # (b), (d) and (e) alternate, so drift (clocks, other work) touches them alike
    kvflow_s, suffix_s, layerwise_s = [], [], []
    for _ in range(repeat):
        kvflow_s.append(_seconds(with_kvflow, device))
        end_sessions()
        suffix_s.append(_seconds(suffix_only, device))
        if layerwise:
            layerwise_s.append(_seconds(with_layerwise, device))
            end_sessions()
    timed_loads = layer_loads[-repeat:] if layerwise else []
    waits = [load.layer_waits() for _, load in timed_loads]
    err = float((got_logits - expected).abs().max() / expected.abs().max())
    assert err <= BF16_TOLERANCE, f"logits off a full recompute by {err:.3g} (relative)"
    nbytes = prefix * shape.kv_bytes_per_token(cache.layers[0].dtype)
    copy_ms = _copy_ms(nbytes, repeat, device)
    return Row(
        model=name,
        prompt=length,
        prefix=prefix,
        suffix=length - prefix,
        prefix_gib=nbytes / (1 << 30),
        recompute_ms=recompute_ms,
        kvflow_ms=1e3 * statistics.median(kvflow_s),
        copy_ms=copy_ms,
        suffix_ms=1e3 * statistics.median(suffix_s),
        added_ms=1e3 * statistics.median(b - d for b, d in zip(kvflow_s, suffix_s, strict=True)),
        retrieve_ms=1e3 * statistics.median(retrieve_s),
        retrieve_server_ms=1e3 * statistics.median(server_s),
        landed_ms=statistics.median(
            begin.elapsed_time(end) if begin is not None else 1e3 * call
            for begin, end, call in landed
        ),
        logits_rel_err=err,
        layerwise_ms=1e3 * statistics.median(layerwise_s) if layerwise else 0.0,
        layer_copy_ms=copy_ms / shape.layers,
        layerwise_call_ms=_ms_median(call for call, _ in timed_loads),
        first_wait_ms=_ms_median(w[0] for w in waits),
        later_waits_ms=_ms_median(sum(w[1:]) for w in waits),
        blocks="in-order" if in_order else "shuffled",
        staged_layers=int(statistics.median(len(load.staged_layers) for _, load in timed_loads))
        if layerwise
        else 0,
        wait_host_ms=_ms_median(load.host_s for _, load in timed_loads),
        wait_host_by_layer_ms=[
            _ms_median(load.host_by_layer.get(layer, 0.0) for _, load in timed_loads)
            for layer in range(shape.layers)
        ]
        if layerwise
        else [],
        ring_scatters=int(statistics.median(load.ring_scatters for _, load in timed_loads))
        if layerwise
        else 0,
        paired_over_floor=statistics.median(
            e / (max(copy_ms / 1e3, d) + copy_ms / 1e3 / shape.layers)
            for e, d in zip(layerwise_s, suffix_s, strict=True)
        )
        if layerwise
        else 0.0,
        suffix_runs_ms=[1e3 * d for d in suffix_s],
        layerwise_runs_ms=[1e3 * e for e in layerwise_s],
        wait_host_runs_ms=[1e3 * load.host_s for _, load in timed_loads],
    )


def _ms_median(seconds: Iterable[float]) -> float:
    """The median in ms (0.0 for none)."""
    values = list(seconds)
    return 1e3 * statistics.median(values) if values else 0.0


def run(args: argparse.Namespace, device: torch.device) -> list[Row]:
    from kvflow.core import KVFlowClient

    dtype = torch.bfloat16
    lengths = sorted(args.lengths)
    shapes = {name: SHAPES[name] for name in args.models}
    largest = max(s.kv_bytes_per_token(dtype) for s in shapes.values()) * lengths[-1]
    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        kvflow_server(
            args.l1_size_gb or max(1.0, 1.5 * largest / (1 << 30)), Path(tmp) / "server.log"
        ) as endpoint,
        KVFlowClient(endpoint, timeout_s=600) as client,
    ):
        for name, shape in shapes.items():
            model = build_model(shape, dtype, device)
            cache = PagedCache(shape, 2 * (lengths[-1] // BLOCK) + 16, dtype, device)
            # a slot holds one layer of the longest prefix
            slot_bytes = shape.kv_bytes_per_token(dtype) // shape.layers * lengths[-1]
            client.register_kv_caches(
                f"ttft-{name}", cache.layers, model_name=f"ttft-{name}", layerwise=args.layerwise,
                staging_slots=args.staging_slots, staging_slot_bytes=slot_bytes,
            )  # fmt: skip
            try:
                _last_logits(model, torch.zeros(CHUNK, dtype=torch.long, device=device))  # warm
                for length in lengths:
                    rows.append(measure(client, name, model, cache, shape, length, args.repeat,
                                        device, args.layerwise, args.blocks == "in-order"))  # fmt: skip
                    print(_format([rows[-1]], header=len(rows) == 1), flush=True)
            finally:
                client.unregister(f"ttft-{name}")
                del model, cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _format(rows: list[Row], header: bool = True) -> str:
    head = (
        f"{'model':<5} {'prompt':>6} {'prefix':>6} {'suffix':>6} {'GiB':>6} "
        f"{'(a) recompute':>13} {'(b) kvflow':>10} {'(c) copy':>9} {'(d) suffix':>10} "
        f"{'retrieve':>9} {'server':>9} {'landed':>9} {'b/a':>6} {'(b-d)/c':>7} "
        f"{'logit err':>9} {'(e) layerwise':>13} {'e/a':>6} {'e/floor':>7}"
    )
    lines = [head] if header else []
    for r in rows:
        lines.append(
            f"{r.model:<5} {r.prompt:>6} {r.prefix:>6} {r.suffix:>6} {r.prefix_gib:>6.3f} "
            f"{r.recompute_ms:>10.2f} ms {r.kvflow_ms:>7.2f} ms {r.copy_ms:>6.2f} ms "
            f"{r.suffix_ms:>7.2f} ms {r.retrieve_ms:>6.2f} ms {r.retrieve_server_ms:>6.2f} ms "
            f"{r.landed_ms:>6.2f} ms "
            f"{r.ratio:>6.3f} "
            f"{r.over_copy:>7.2f} {r.logits_rel_err:>9.2e} {r.layerwise_ms:>10.2f} ms "
            f"{r.layerwise_ratio:>6.3f} {r.layerwise_over_floor:>7.2f}"
        )
    waits = [r for r in rows if r.layerwise_ms]
    if waits and header:
        lines.append(
            f"\n{'model':<5} {'prompt':>6} {'(e) call':>9} {'layer 0 wait':>12} {'later waits':>11}"
            f" {'e/floor paired':>14} {'staged':>6} {'scatters':>8} {'host in waits':>13}"
            f" {'of it layer 0':>13} {'layers 1-12':>11}"
        )
    for r in waits:
        lines.append(
            f"{r.model:<5} {r.prompt:>6} {r.layerwise_call_ms:>6.2f} ms {r.first_wait_ms:>9.2f} ms "
            f"{r.later_waits_ms:>8.2f} ms {r.paired_over_floor:>14.2f} {r.staged_layers:>6}"
            f" {r.ring_scatters:>8} {r.wait_host_ms:>10.2f} ms"
            f" {r.wait_host_by_layer_ms[0]:>10.2f} ms {sum(r.wait_host_by_layer_ms[1:13]):>8.2f} ms"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    """TTFT against prompt length: four lines per model (five with (e)), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=[*SHAPES].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    series = [("recompute_ms", "(a) recompute"), ("kvflow_ms", "(b) kvflow retrieve + suffix"),
              ("copy_ms", "(c) pinned copy of the prefix"), ("suffix_ms", "(d) suffix prefill")]  # fmt: skip
    if any(r.get("layerwise_ms") for r in rows):
        series.append(("layerwise_ms", "(e) layerwise retrieve + suffix"))
    for ax, model in zip(axes[0], models, strict=True):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["prompt"])
        for key, label in series:
            ax.plot([r["prompt"] for r in mine], [r[key] for r in mine], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms",
               title=f"time to first token, {model}")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["1b", "8b"])
    parser.add_argument("--lengths", type=_ints, default=[2048, 8192, 32768])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (median)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--l1-size-gb", type=float, help="server L1 (default: 1.5 x largest)")
    parser.add_argument(
        "--layerwise", action="store_true", help="add (e): a layerwise retrieve + the suffix"
    )
    parser.add_argument(
        "--blocks", choices=("shuffled", "in-order"), default="shuffled",
        help="where the prompt's blocks are in the cache: shuffled (default; a busy engine)"
        " or in order (a fresh engine's allocation)",
    )  # fmt: skip
    parser.add_argument(
        "--staging-slots", type=int, default=0, metavar="N",
        help="with --layerwise: a ring of N slots in the engine's memory (each one layer of"
        " the longest prefix) where the server stages layers that need a scatter, which the"
        " engine does itself (docs/ENGINE.md, 'Staging in the engine'); 0 (default): none",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, metavar="ROWS.json", help="only draw these rows")
    parser.add_argument("--png", type=Path, help="with --plot (or a run): the PNG to write")
    args = parser.parse_args(argv)
    if args.plot is not None:
        plot(json.loads(args.plot.read_text()), args.png or args.plot.with_suffix(".png"))
        return 0
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown or args.repeat < 1 or not args.lengths or min(args.lengths) <= CHUNK:
        parser.error(f"--models from {', '.join(SHAPES)}; --repeat >= 1; --lengths > {CHUNK}")
    if args.staging_slots and not args.layerwise:
        parser.error("--staging-slots goes with --layerwise")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_ttft: no CUDA device (use --device cpu)", file=sys.stderr)
        return 1
    torch.set_grad_enabled(False)
    try:
        rows = run(args, device)
    except AssertionError as exc:
        print(f"bench_ttft: check failed: {exc}", file=sys.stderr)
        return 1
    print()
    print(_format(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.png is not None:
        plot([asdict(r) for r in rows], args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
