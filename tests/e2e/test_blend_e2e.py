"""Blend end to end (tests/e2e/blend_e2e.py) on CPU through the session's `kvflow server`,
and the selective recompute (benchmarks/blend_recompute.py) proven without kvflow."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvflow.core import KVFlowClient
from kvflow.core.engine.blend_index import BlendSegment
from kvflow.kernels.rope_params import Llama3Scaling, RopeParams
from tests.e2e.blend_e2e import (
    CAVEAT,
    check_layer0,
    documents_from_texts,
    format_report,
    last_logits,
    main,
    make_documents,
    recompute,  # benchmarks/blend_recompute.py
    run_blend,
)
from tests.e2e.tiny_llama import HEAD_SIZE, ModelFor, prefill, relative_error

blended_runs, choose, forced_tokens = (
    recompute.blended_runs,
    recompute.choose,
    recompute.forced_tokens,
)
rope_params, selective_prefill = recompute.rope_params, recompute.selective_prefill

#: What the lookup finds in the new prompt (system 32, B 80, A 112, question 16): B's two
#: whole chunks (its first 16 tokens shared a stored chunk with A's tail) and A's three,
#: as (offset, original_start); every chunk is 32 tokens.
FOUND = [(48, 160), (80, 192), (112, 32), (144, 64), (176, 96)]
PROMPT_TOKENS, PREFIX = 240, 32
#: Tokens recomputed at fraction 0: the 48 no chunk covers and the first 4 of both runs.
FORCED = 48 + 2 * 4


def _segments() -> list[BlendSegment]:
    return [BlendSegment(offset, 32, b"chunk", start) for offset, start in FOUND]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_documents_moved_blend_and_a_full_recompute_is_exact(
    kvflow_client: KVFlowClient, model_for: ModelFor, dtype: torch.dtype
) -> None:
    model, docs = model_for(dtype, "cpu"), make_documents()
    # run_blend asserts layer 0 (K within the rotation bound, V bit-exact) and fraction 1.0
    # (logits and every token's KV equal to a full prefill's)
    report = run_blend(kvflow_client, model, docs)
    assert (report.prompt_tokens, report.prefix) == (PROMPT_TOKENS, PREFIX)
    assert [(s.offset, s.length, s.original_start) for s in report.segments] == [
        (offset, 32, start) for offset, start in FOUND
    ]
    assert report.runs == [(48, 112), (112, 208)]
    assert 0 < report.layer0_k_bound <= 1
    rows = {r.fraction: r for r in report.rows}
    assert [r.recomputed for r in report.rows] == [FORCED, FORCED + 16, FORCED + 40, 136, 208]
    assert rows[1.0].max_abs == rows[1.0].relative == 0
    # the blended deeper layers do differ from a fresh prefill: the comparison has teeth
    assert rows[0.0].relative > 1e-2
    text = format_report(report, model, docs, check_layer=1)
    assert CAVEAT in text and "1.00    208 / 208" in text and "(exact)" in text
    print(text)


def test_exact_kv_needs_no_recompute_and_uncovered_tokens_are_never_read(
    model_for: ModelFor,
) -> None:
    """Without kvflow: given a full prefill's KV where the segments are (NaN elsewhere),
    fraction 0 reproduces the full prefill's logits. The passes attend by position (keys in
    another order than the prompt's) and never read a token nothing covered."""
    model, prompt = model_for(torch.float32, "cpu"), make_documents().prompt
    full = prefill(model, prompt)
    kv = torch.full_like(full.kv, float("nan"))
    kv[:, :, :PREFIX] = full.kv[:, :, :PREFIX]
    for s in _segments():
        kv[:, :, s.offset : s.offset + s.length] = full.kv[:, :, s.offset : s.offset + s.length]
    out = selective_prefill(model, prompt, kv, PREFIX, _segments(), fraction=0.0)
    assert out.num_recomputed == FORCED
    assert relative_error(out.logits, last_logits(model, prompt)) <= 1e-5
    assert not out.kv.isnan().any(), "a token nothing covered kept no KV"
    # tokens left alone keep their KV past the check layer (layer 1's is fresh for all)
    kept = ~out.recomputed
    assert torch.equal(out.kv[2:, :, kept], full.kv[2:, :, kept])


def test_layer0_check_catches_k_left_at_its_stored_position(model_for: ModelFor) -> None:
    """Segments copied without turning K: V still matches, K fails the rotation bound."""
    model, docs = model_for(torch.float32, "cpu"), make_documents()
    fresh = prefill(model, docs.prompt).kv[0]
    stored = prefill(model, docs.stored).kv[0]
    unturned = fresh.clone()
    for s in _segments():
        unturned[:, s.offset : s.offset + 32] = stored[:, s.original_start : s.original_start + 32]
    with pytest.raises(AssertionError, match="layer-0 K of the segment at 48"):
        check_layer0(unturned, fresh, _segments(), HEAD_SIZE)


def test_runs_forced_tokens_and_the_deviation_rule() -> None:
    # chunks stored one after the other form a run; a chunk stored elsewhere starts one
    segments = [BlendSegment(10, 4, b"a", 40), BlendSegment(14, 4, b"b", 44),
                BlendSegment(18, 4, b"c", 0)]  # fmt: skip
    assert blended_runs(list(reversed(segments))) == [(10, 18), (18, 22)]
    runs = blended_runs(segments)
    forced = forced_tokens(24, 8, runs, first_k=1)
    assert forced.nonzero().flatten().tolist() == [8, 9, 10, 18, 22, 23]
    deviation = torch.arange(24, dtype=torch.float32).flip(0)  # larger for earlier tokens
    # ceil(0.25 x 12 run tokens) = 3 more: the run tokens with the largest deviation
    assert choose(deviation, runs, forced, 0.25).nonzero().flatten().tolist() == [
        8, 9, 10, 11, 12, 13, 18, 22, 23,
    ]  # fmt: skip
    assert choose(deviation, runs, forced, 1.0)[8:].all()
    assert torch.equal(choose(deviation, runs, forced, 0.0), forced)


def test_rope_params_follow_the_model_config() -> None:
    tiny = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    assert rope_params(tiny) == RopeParams(16, theta=10000.0)
    llama3 = LlamaConfig(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    })  # fmt: skip
    assert rope_params(llama3) == RopeParams(
        128, theta=500000.0, scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192)
    )
    yarn = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn' is not one kvflow can turn"):
        rope_params(yarn)


def test_real_text_documents_and_arguments() -> None:
    class Tokenizer:  # a tokenizer's call and BOS, as AutoTokenizer gives them
        bos_token_id = 1

        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            assert not add_special_tokens
            return {"input_ids": [len(word) + 1 for word in text.split()]}

    texts = {"system": "be brief", "documents": ["a bb", "ccc"], "question": "why"}
    docs = documents_from_texts(Tokenizer(), texts)
    assert docs.prompt.tolist() == [1, 3, 6, 4, 2, 3, 4]
    assert docs.stored.tolist() == [1, 3, 6, 2, 3, 4]
    with pytest.raises(SystemExit) as exc:
        main(["--model", "some-dir"])
    assert exc.value.code == 2
