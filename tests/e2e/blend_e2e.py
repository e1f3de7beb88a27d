"""Blend end to end: documents stored in one order, reused in another (docs/E2E.md, "Blend").

A worker registers its paged caches and the model's RoPE with a `kvflow server`, prefills
a system prompt and two documents (A then B) and stores them; the cache is then wiped.
A new prompt puts them the other way round and adds a question: its prefix (the system
prompt) comes back by `retrieve`, the documents' chunks found at their new offsets by
`blend_lookup` + `blend_retrieve` (K turned to the new positions), and the tokens no
chunk covers (the question, each document's part of a chunk it shares with the other)
stay NaN. Layer 0 of every blended token must equal a fresh prefill's (K within the
rotation bound, V bit-exact). Then CacheBlend's selective recompute
(benchmarks/blend_recompute.py, shared with benchmarks/bench_blend.py) runs for several fractions and its last-token logits are
compared with a full prefill of the prompt: at fraction 1.0 they, and the whole KV, must
be equal, bit for bit.

With the tiny Llama's random weights the differences show the mechanism, not the
quality a trained model keeps at a fraction (CAVEAT); `--model DIR --texts FILE` runs the
same with a trained model and real text. Run from the repository root:
    python -m tests.e2e.blend_e2e [--dtype fp32|bf16] [--fractions 0,0.1,0.25,0.5,1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.engine.blend_index import BlendSegment
from tests.e2e import paged_kv
from tests.e2e.scenario import BLOCK_SIZE, CHUNK_SIZE
from tests.e2e.server_proc import running_server
from tests.e2e.tiny_llama import VOCAB_SIZE, build_model, prefill

# the selective recompute is shared with benchmarks/bench_blend.py, which may not import tests
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import blend_recompute as recompute

Documents, blended_runs = recompute.Documents, recompute.blended_runs
rope_params, selective_prefill = recompute.rope_params, recompute.selective_prefill

#: The tiny model's documents, in tokens: the system prompt is one chunk (the prefix hit);
#: A ends 16 tokens into a chunk and B starts there, so that chunk (A's tail, B's head) is
#: found in neither order and stays to be recomputed.
SYSTEM_TOKENS, DOC_A_TOKENS, DOC_B_TOKENS, QUESTION_TOKENS = 32, 112, 80, 16
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)
LAYOUT = "vllm_flash_attn"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CAVEAT = (
    "The model has random weights: these logit differences show the mechanism (exact at\n"
    "fraction 1.0, what the blended KV leaves otherwise), not the quality a trained model\n"
    "keeps at a given fraction. For that, run this harness with a trained model and real\n"
    "documents (--model DIR --texts FILE; docs/E2E.md, 'Blend')."
)

_run_numbers = itertools.count()


def make_documents(seed: int = 2, vocab: int = VOCAB_SIZE) -> Documents:
    """Random documents of the tiny model's sizes; the same seed, the same ids."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (SYSTEM_TOKENS, DOC_A_TOKENS, DOC_B_TOKENS, QUESTION_TOKENS)
    return Documents(*(torch.randint(0, vocab, (n,), generator=gen) for n in sizes))


def documents_from_texts(tokenizer: Any, texts: dict[str, Any]) -> Documents:
    """Documents of real text ({"system": str, "documents": [str, str], "question": str}),
    tokenized without special tokens (the system prompt gets the tokenizer's BOS, if any)."""

    def ids(text: str, bos: bool = False) -> torch.Tensor:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        first = [tokenizer.bos_token_id] if bos and tokenizer.bos_token_id is not None else []
        return torch.tensor(first + list(tokens), dtype=torch.long)

    doc_a, doc_b = texts["documents"]
    return Documents(ids(texts["system"], bos=True), ids(doc_a), ids(doc_b), ids(texts["question"]))


@dataclass(frozen=True)
class FractionRow:
    """One fraction's result: tokens recomputed past the check layer (of those past the
    prefix) and the last logits' difference from a full prefill."""

    fraction: float
    recomputed: int
    max_abs: float
    relative: float  # max_abs / max |full prefill logit|


@dataclass(frozen=True)
class BlendReport:
    """What a blend run found and measured (its checks assert)."""

    prompt_tokens: int
    prefix: int
    segments: list[BlendSegment]
    layer0_k_bound: float  # largest |layer-0 K - fresh K| / its allowed error (<= 1)
    rows: list[FractionRow]

    @property
    def runs(self) -> list[tuple[int, int]]:
        return blended_runs(self.segments)

    @property
    def blended(self) -> int:
        return sum(s.length for s in self.segments)


class BlendWorker:
    """An engine worker's paged caches (vllm_flash_attn in shared memory, shaped from the
    model's config), registered with the model's RoPE. The harness runs on the CPU; the
    GPU timing is benchmarks/bench_blend.py's."""

    def __init__(self, client: KVFlowClient, model: Any, num_blocks: int) -> None:
        config = model.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.caches = paged_kv.allocate(
            LAYOUT, num_layers=config.num_hidden_layers, num_blocks=num_blocks,
            block_size=BLOCK_SIZE, num_heads=config.num_key_value_heads, head_size=head_dim,
            dtype=model.dtype, empty=empty_shared,
        )  # fmt: skip
        paged_kv.fill(self.caches, float("nan"))
        tag = f"{os.getpid()}-{next(_run_numbers)}"
        self.client, self.num_blocks = client, num_blocks
        self.instance_id, self.model_name = f"blend-{tag}", f"blend-model-{tag}"
        client.register_kv_caches(
            self.instance_id, self.caches, model_name=self.model_name, ropes=rope_params(config)
        )

    def close(self) -> None:
        """Unregister from the server."""
        self.client.unregister(self.instance_id)


def store_documents(worker: BlendWorker, model: Any, docs: Documents, gen: torch.Generator) -> None:
    """Prefill system + A + B, store its full chunks, then lose every block (NaN)."""
    stored = docs.stored
    table = paged_kv.random_block_table(worker.num_blocks, len(stored), BLOCK_SIZE, gen)
    paged_kv.write_kv(worker.caches, LAYOUT, prefill(model, stored).kv, table)
    got = worker.client.store(worker.instance_id, stored, table, request_id="blend-store")
    assert got == len(stored) // CHUNK_SIZE * CHUNK_SIZE, f"stored {got} of {len(stored)}"
    worker.client.end_session("blend-store")
    paged_kv.fill(worker.caches, float("nan"))


def blend_prompt(
    worker: BlendWorker, docs: Documents, gen: torch.Generator
) -> tuple[int, list[BlendSegment], torch.Tensor]:
    """Blend lookup, retrieve of the prefix and blend retrieve of the segments into a new
    block table; returns the prefix, the segments and the prompt's KV [NL, 2, T, NH, HS]
    as the blocks hold it (NaN where nothing was written)."""
    client, prompt = worker.client, docs.prompt
    hit = client.blend_lookup(prompt, model_name=worker.model_name, request_id="blend-prompt")
    table = paged_kv.random_block_table(worker.num_blocks, len(prompt), BLOCK_SIZE, gen)
    got = client.retrieve(worker.instance_id, prompt, table, request_id="blend-prompt")
    assert got == hit.prefix_tokens, f"retrieved {got} of a {hit.prefix_tokens}-token prefix"
    blended = client.blend_retrieve(
        worker.instance_id, prompt, table, hit.segments, request_id="blend-prompt"
    )
    assert blended == (hit.blended_tokens, ()), f"blended {blended} of {hit.blended_tokens} tokens"
    client.end_session("blend-prompt")
    return (
        hit.prefix_tokens,
        hit.segments,
        paged_kv.read_kv(worker.caches, LAYOUT, len(prompt), table),
    )


def check_layer0(
    blended: torch.Tensor, fresh: torch.Tensor, segments: Sequence[BlendSegment], rotary_dim: int
) -> float:
    """Assert layer 0 of every segment token equals a fresh prefill's: V and K's dims past
    `rotary_dim` bit-exact, K's rotary dims within the rotation's error. The bound, with u
    the dtype's unit roundoff and n the norm of an element's rotated pair: kvflow's turn,
    u |K| + 2^-21 n (docs/KERNELS.md), plus transformers' own RoPE at both positions, the
    stored one and the new one: float32 angles (2^-24 x position rad: inverse
    frequencies <= 1) and cos/sin, two products and a sum in the model dtype (4u n each).
    Returns the largest error over its bound. `blended`, `fresh`: layer 0, [2, T, NH, HS]."""
    unit = torch.finfo(blended.dtype).eps / 2
    worst = 0.0
    for s in segments:
        span = slice(s.offset, s.offset + s.length)
        got, want = blended[:, span].double(), fresh[:, span].double()
        assert torch.equal(blended[1, span], fresh[1, span]), f"layer-0 V differs at {s.offset}"
        assert torch.equal(got[0, ..., rotary_dim:], want[0, ..., rotary_dim:])
        half = rotary_dim // 2
        pair_norm = want[0, ..., :half].hypot(want[0, ..., half:rotary_dim]).repeat(1, 1, 2)
        both = torch.arange(s.length, dtype=torch.float64) * 2 + s.offset + s.original_start
        angles = 2.0**-24 * both[:, None, None]  # the two positions' sum, per token
        bound = pair_norm * (angles + 8 * unit + 2.0**-21) + unit * want[0, ..., :rotary_dim].abs()
        ratio = float(((got[0, ..., :rotary_dim] - want[0, ..., :rotary_dim]).abs() / bound).max())
        assert ratio <= 1.0, f"layer-0 K of the segment at {s.offset}: {ratio:.3g} x its bound"
        worst = max(worst, ratio)
    return worst


def run_blend(
    client: KVFlowClient,
    model: Any,
    docs: Documents,
    *,
    fractions: Sequence[float] = FRACTIONS,
    first_k: int = 4,
    check_layer: int = 1,
    seed: int = 3,
) -> BlendReport:
    """Store, blend, check layer 0, then the selective recompute at each fraction against
    a full prefill (fraction 1.0, if listed, must give its logits and KV exactly)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = docs.prompt
    num_blocks = -(-len(docs.stored) // BLOCK_SIZE) + -(-len(prompt) // BLOCK_SIZE) + 2
    worker = BlendWorker(client, model, num_blocks)
    try:
        store_documents(worker, model, docs, gen)
        prefix, segments, kv = blend_prompt(worker, docs, gen)
    finally:
        worker.close()
    full = prefill(model, prompt)
    bound = check_layer0(kv[0], full.kv[0], segments, rope_params(model.config).rotary_dim)
    expected = last_logits(model, prompt)
    rows = []
    for fraction in fractions:
        out = selective_prefill(
            model, prompt, kv.clone(), prefix, segments,
            fraction=fraction, first_k=first_k, check_layer=check_layer,
        )  # fmt: skip
        diff = float((out.logits.double() - expected.double()).abs().max())
        if fraction == 1.0:
            assert torch.equal(out.logits, expected), f"fraction 1.0 is off a full prefill: {diff}"
            assert torch.equal(out.kv, full.kv), "fraction 1.0 KV differs from a full prefill's"
        scale = float(expected.double().abs().max())
        rows.append(FractionRow(fraction, out.num_recomputed, diff, diff / scale))
    return BlendReport(len(prompt), prefix, segments, bound, rows)


def last_logits(model: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """The last token's logits from a full prefill of `token_ids`, computed for that token
    alone (`logits_to_keep=1`, as engines do)."""
    with torch.no_grad():
        return model(token_ids.unsqueeze(0), logits_to_keep=1).logits[0, -1]


def format_report(report: BlendReport, model: Any, docs: Documents, check_layer: int) -> str:
    """The run as text: what was stored and found, the fractions table, the caveat."""
    config = model.config
    rest = report.prompt_tokens - report.prefix
    runs = " ".join(f"[{a}, {b})" for a, b in report.runs)
    lines = [
        f"blend e2e: {config.num_hidden_layers}-layer {type(model).__name__}, "
        f"{str(model.dtype).removeprefix('torch.')} on the CPU, "
        f"chunk {CHUNK_SIZE}, block {BLOCK_SIZE}",
        f"stored: system {len(docs.system)} + A {len(docs.doc_a)} + B {len(docs.doc_b)} tokens;"
        f" prompt: system + B + A + question {len(docs.question)} = {report.prompt_tokens} tokens",
        f"found: prefix {report.prefix}, {len(report.segments)} segments ({report.blended} tokens)"
        f" in runs {runs}; {rest - report.blended} tokens not covered",
        f"layer 0 of the segments: V bit-exact, K within {report.layer0_k_bound:.2g} x the "
        "rotation bound",
        f"recompute: tokens not covered, the first tokens of each run, the fraction of the "
        f"{report.blended} segment tokens with the largest layer-{check_layer} KV deviation",
        "",
        f"{'fraction':>8}  {'recomputed':>12}  {'max |dlogit|':>12}  {'relative':>9}",
    ]
    for r in report.rows:
        lines.append(
            f"{r.fraction:>8.2f}  {r.recomputed:>5} / {rest:<4}  {r.max_abs:>12.3e}  "
            f"{r.relative:>9.2e}" + ("  (exact)" if r.max_abs == 0 else "")
        )
    return "\n".join([*lines, "", CAVEAT])


def _load(args: argparse.Namespace) -> tuple[Any, Documents]:
    """The tiny Llama and random documents, or a trained model from a local directory
    (eager attention) and the documents of --texts tokenized by its tokenizer."""
    dtype = DTYPES[args.dtype]
    if args.model is None:
        return build_model(dtype), make_documents()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation="eager", local_files_only=True
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    return model, documents_from_texts(tokenizer, json.loads(args.texts.read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--fractions", type=lambda s: [float(v) for v in s.split(",")],
                        default=list(FRACTIONS))  # fmt: skip
    parser.add_argument("--first-k", type=int, default=4, help="tokens recomputed per run")
    parser.add_argument("--check-layer", type=int, default=1, help="the layer that selects")
    parser.add_argument("--model", type=Path, help="a trained Llama-family model's directory")
    parser.add_argument(
        "--texts", type=Path, help="with --model: JSON of system, documents, question"
    )
    args = parser.parse_args(argv)
    if (args.model is None) != (args.texts is None):
        parser.error("--model and --texts go together")
    torch.set_float32_matmul_precision("highest")
    model, docs = _load(args)
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(CHUNK_SIZE, Path(tmp) / "server.log") as endpoint,
        KVFlowClient(endpoint, timeout_s=60.0) as client,
    ):
        report = run_blend(client, model, docs, fractions=args.fractions,
                           first_k=args.first_k, check_layer=args.check_layer)  # fmt: skip
    print(format_report(report, model, docs, args.check_layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
