"""Time to first token with blend: documents reused in another order vs a full prefill.

A system prompt (one chunk) and two documents, A then B, are prefilled and stored through
a `kvflow server` subprocess. The prompt timed puts them the other way round and adds a
question (8b: two 4096-token documents, a 256-token question: 8704 tokens):
  (a) full      a full prefill of the prompt (no KV reused)
  (b) prefix    retrieve the prefix (the system prompt), prefill everything after it:
                what a prefix cache alone gives when the documents moved
  (c) blend     blend_lookup, retrieve of the prefix, blend_retrieve of the documents'
                chunks (K turned to their new positions), the prompt's KV gathered from
                the paged cache, then CacheBlend's selective recompute at the fraction
                (benchmarks/blend_recompute.py): layer 0 and layer 1's K/V for every
                token, then from layer 1 on the question, each document's first tokens
                and the fraction of document tokens whose layer-1 KV deviates most;
                the pass ends with the question prefilled and the last token's logits
Medians of --repeat runs, (a), (b) and (c) alternating; (c)'s parts (lookup, the two
retrieves, the recompute) are medians too. With random weights the logit error against
(a) says nothing about a trained model's quality (docs/E2E.md, "Blend"); at fraction 1.0
it must be within bf16 rounding of (a) (a failed check exits 1).

    python benchmarks/bench_blend.py --device cuda --shape 8b --fractions 0,0.15,0.3,1
    python benchmarks/bench_blend.py --device cpu --shape toy --doc-tokens 512 --question-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_ttft import (  # this folder is on sys.path when run as a script
    BF16_TOLERANCE,
    BLOCK,
    CHUNK,
    SHAPES,
    PagedCache,
    Shape,
    _last_logits,
    _seconds,
    _sync,
    build_model,
    kvflow_server,
)
from blend_recompute import Documents, rope_params, selective_prefill

from kvflow.core.engine.blend import BlendHit

INSTANCE = MODEL_NAME = "bench-blend"


@dataclass
class Row:
    """One fraction's result; times in milliseconds (medians)."""

    shape: str
    prompt: int
    prefix: int
    blended: int
    fraction: float
    recomputed: int  # tokens recomputed past the check layer (of prompt - prefix)
    full_ms: float  # (a)
    prefix_ms: float  # (b)
    blend_ms: float  # (c), the sum of its parts in each run
    lookup_ms: float
    retrieve_ms: float  # retrieve of the prefix + blend_retrieve, until the KV landed
    recompute_ms: float  # gather of the prompt's KV + the selective recompute
    logits_rel_err: float  # (c)'s last logits vs (a)'s, relative to the largest

    @property
    def speedup(self) -> float:
        """(a) / (c)."""
        return self.full_ms / self.blend_ms


def make_documents(shape: Shape, doc_tokens: int, question_tokens: int) -> Documents:
    """Random token documents: a one-chunk system prompt, two documents, a question."""
    gen = torch.Generator().manual_seed(7)
    sizes = (CHUNK, doc_tokens, doc_tokens, question_tokens)
    return Documents(*(torch.randint(0, shape.vocab, (n,), generator=gen) for n in sizes))


def gather(cache: PagedCache, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The KV of `table`'s first `num_tokens` tokens as [NL, 2, T, NH, HS] (a copy)."""
    index = table.to(cache.layers[0].device)
    return torch.stack([view[:, index].flatten(1, 2)[:, :num_tokens] for view in cache.layers])


class Bench:
    """The model, its paged cache registered with the server (and its RoPE), the stored
    documents, and the timed steps of one prompt."""

    def __init__(self, client: Any, model: Any, docs: Documents, args: argparse.Namespace) -> None:
        self.client, self.model, self.docs, self.args = client, model, docs, args
        self.device = model.device
        self.prompt = docs.prompt
        self.ids = self.prompt.to(self.device)
        stored_blocks = -(-len(docs.stored) // BLOCK)
        prompt_blocks = -(-len(self.prompt) // BLOCK)
        shape = SHAPES[args.shape]
        self.cache = PagedCache(shape, stored_blocks + prompt_blocks, model.dtype, self.device)
        order = torch.randperm(
            stored_blocks + prompt_blocks, generator=torch.Generator().manual_seed(0)
        )
        self.stored_at, self.table = order[:stored_blocks], order[stored_blocks:]
        client.register_kv_caches(
            INSTANCE, self.cache.layers, model_name=MODEL_NAME, ropes=rope_params(model.config)
        )
        self.requests = iter(range(1 << 30))

    def store(self) -> None:
        """Prefill system + A + B and store its full chunks."""
        stored = self.docs.stored
        with torch.no_grad():
            out = self.model(stored.to(self.device).unsqueeze(0), use_cache=True, logits_to_keep=1)
        past = out["cache"] if "cache" in out else out["past_key_values"]
        self.cache.write(past, len(stored), self.stored_at)
        del out, past
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        got = self.client.store(INSTANCE, stored, self.stored_at, request_id="blend-store")
        assert got == len(stored) // CHUNK * CHUNK, f"stored {got} of {len(stored)} tokens"
        self.client.end_session("blend-store")

    def prefix_only(self) -> torch.Tensor:
        """(b): retrieve the prefix, prefill the rest on top."""
        rid = f"prefix-{next(self.requests)}"
        prefix = self.client.retrieve(INSTANCE, self.prompt, self.table, request_id=rid)
        past = self.cache.past(self.model, prefix, self.table)
        logits = _last_logits(self.model, self.ids[prefix:], past)
        self.client.end_session(rid)
        return logits

    def blend(
        self, fraction: float, parts: list[tuple[float, float, float]]
    ) -> tuple[BlendHit, Any]:
        """(c); appends its parts' seconds (lookup, retrieves, recompute) to `parts`.
        Returns the lookup's hit and the selective recompute's result (`Recomputed`)."""
        rid, device = f"blend-{next(self.requests)}", self.device
        started = time.perf_counter()
        hit = self.client.blend_lookup(self.prompt, model_name=MODEL_NAME, request_id=rid)
        looked = time.perf_counter()
        prefix = self.client.retrieve(INSTANCE, self.prompt, self.table, request_id=rid)
        blended = self.client.blend_retrieve(
            INSTANCE, self.prompt, self.table, hit.segments, request_id=rid
        )
        _sync(device)  # the retrieved KV landed
        landed = time.perf_counter()
        assert (prefix, blended) == (hit.prefix_tokens, (hit.blended_tokens, ())), (prefix, blended)
        kv = gather(self.cache, self.table, len(self.prompt))
        out = selective_prefill(
            self.model, self.ids, kv, prefix, hit.segments, fraction=fraction,
            first_k=self.args.first_k, check_layer=self.args.check_layer,
        )  # fmt: skip
        _sync(device)
        parts.append((looked - started, landed - looked, time.perf_counter() - landed))
        self.client.end_session(rid)
        return hit, out


def _ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def measure(bench: Bench, fraction: float, repeat: int) -> Row:
    """One fraction: (a), (b) and (c) alternating `repeat` times, after a checked run of
    (c) into blocks wiped with NaN (a run that read an unwritten slot gives NaN logits)."""
    model, ids = bench.model, bench.ids
    expected = _last_logits(model, ids)
    bench.cache.fill(bench.table, float("nan"))
    hit, checked = bench.blend(fraction, [])
    assert hit.prefix_tokens == len(bench.docs.system), f"prefix hit {hit.prefix_tokens}"
    assert hit.blended_tokens, "no chunk of the documents was found at its new offset"
    err = float((checked.logits.float() - expected).abs().max() / expected.abs().max())
    assert checked.logits.isfinite().all(), "the blended prompt's logits are not finite"
    if fraction == 1.0:
        assert err <= BF16_TOLERANCE, f"fraction 1.0 is off a full prefill by {err:.3g}"
    full_s, prefix_s, parts = [], [], list[tuple[float, float, float]]()
    for _ in range(repeat):
        full_s.append(_seconds(lambda: _last_logits(model, ids), bench.device))
        prefix_s.append(_seconds(bench.prefix_only, bench.device))
        bench.blend(fraction, parts)
    return Row(
        shape=bench.args.shape, prompt=len(ids), prefix=hit.prefix_tokens,
        blended=hit.blended_tokens, fraction=fraction,
        recomputed=checked.num_recomputed, full_ms=_ms(full_s), prefix_ms=_ms(prefix_s),
        blend_ms=_ms([sum(p) for p in parts]), lookup_ms=_ms([p[0] for p in parts]),
        retrieve_ms=_ms([p[1] for p in parts]), recompute_ms=_ms([p[2] for p in parts]),
        logits_rel_err=err,
    )  # fmt: skip


def run(args: argparse.Namespace, device: torch.device) -> list[Row]:
    """Every fraction of --fractions against one server, model and stored documents."""
    from kvflow.core import KVFlowClient

    shape = SHAPES[args.shape]
    model = build_model(shape, torch.bfloat16, device)
    docs = make_documents(shape, args.doc_tokens, args.question_tokens)
    stored_gib = len(docs.stored) * shape.kv_bytes_per_token(torch.bfloat16) / (1 << 30)
    with (
        tempfile.TemporaryDirectory() as tmp,
        kvflow_server(args.l1_size_gb or max(1.0, 1.5 * stored_gib), Path(tmp) / "s.log") as ep,
        KVFlowClient(ep, timeout_s=600) as client,
    ):
        bench = Bench(client, model, docs, args)
        try:
            bench.store()
            _last_logits(model, bench.ids[:CHUNK])  # warm-up
            rows = []
            for fraction in args.fractions:
                rows.append(measure(bench, fraction, args.repeat))
                print(_format(rows[-1:], header=len(rows) == 1), flush=True)
        finally:
            client.unregister(INSTANCE)
    return rows


def _format(rows: list[Row], header: bool = True) -> str:
    head = (
        f"{'shape':<5} {'prompt':>6} {'prefix':>6} {'blended':>7} {'fraction':>8} "
        f"{'recomp':>6} {'(a) full':>10} {'(b) prefix':>10} {'(c) blend':>10} {'lookup':>8} "
        f"{'retrieve':>9} {'recompute':>10} {'a/c':>6} {'logit err':>9}"
    )
    lines = [head] if header else []
    for r in rows:
        lines.append(
            f"{r.shape:<5} {r.prompt:>6} {r.prefix:>6} {r.blended:>7} {r.fraction:>8.2f} "
            f"{r.recomputed:>6} {r.full_ms:>7.2f} ms {r.prefix_ms:>7.2f} ms {r.blend_ms:>7.2f} ms "
            f"{r.lookup_ms:>5.2f} ms {r.retrieve_ms:>6.2f} ms {r.recompute_ms:>7.2f} ms "
            f"{r.speedup:>6.2f} {r.logits_rel_err:>9.2e}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=SHAPES, default="8b")
    parser.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document")
    parser.add_argument("--question-tokens", type=int, default=256)
    parser.add_argument("--fractions", default=[0.15],
                        type=lambda s: [float(v) for v in s.split(",")])  # fmt: skip
    parser.add_argument("--first-k", type=int, default=4, help="recomputed tokens per document")
    parser.add_argument("--check-layer", type=int, default=1, help="the layer that selects")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per fraction (median)")
    parser.add_argument("--l1-size-gb", type=float, help="server L1 (default: 1.5 x the stored KV)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    layers = SHAPES[args.shape].layers
    if (
        args.doc_tokens < CHUNK or args.doc_tokens % BLOCK or args.question_tokens < 1
        or args.repeat < 1 or not all(0.0 <= f <= 1.0 for f in args.fractions)
        or args.first_k < 0 or not 0 <= args.check_layer < layers
    ):  # fmt: skip
        parser.error(f"--doc-tokens >= {CHUNK}, a multiple of {BLOCK}; --question-tokens >= 1; "
                     f"--repeat >= 1; --fractions in [0, 1]; --first-k >= 0; "
                     f"0 <= --check-layer < {layers}")  # fmt: skip
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        from kvflow.kernels import cuda_available

        if not cuda_available():
            print("bench_blend: needs a CUDA GPU and pycuda (or --device cpu --shape toy)",
                  file=sys.stderr)  # fmt: skip
            return 1
    torch.set_grad_enabled(False)
    try:
        rows = run(args, device)
    except AssertionError as exc:
        print(f"bench_blend: check failed: {exc}", file=sys.stderr)
        return 1
    print()
    print(_format(rows))
    print("\nrandom weights: the logit error says nothing about a trained model's quality")
    if args.json is not None:
        args.json.write_text(
            json.dumps([asdict(r) | {"speedup": r.speedup} for r in rows], indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
