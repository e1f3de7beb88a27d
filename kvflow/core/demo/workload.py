"""Synthetic request streams with shared prefixes, for the demo and benchmarks.

Two patterns real deployments see: multi-turn chat (every turn's prompt is the
previous turn's prompt and answer plus a new message, all after one system
prompt) and document Q&A (several questions after the same long document).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvflow.core.engine.keys import chain_hashes


@dataclass(frozen=True)
class SimRequest:
    """One engine request: its prompt, the tokens it will generate, and its kind."""

    request_id: str
    kind: str
    prompt: np.ndarray
    output: np.ndarray


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of the synthetic workload (tokens)."""

    chats: int = 6
    turns: int = 4
    system_tokens: int = 600
    message_tokens: tuple[int, int] = (80, 300)
    docs: int = 3
    questions: int = 5
    doc_tokens: tuple[int, int] = (1500, 2600)
    question_tokens: tuple[int, int] = (20, 80)
    output_tokens: tuple[int, int] = (40, 200)
    vocab: int = 32000

    def __post_init__(self) -> None:
        for name in ("chats", "turns", "docs", "questions"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"--{name} must be an integer >= 0, got {value!r}")


def make_workload(shape: WorkloadShape, seed: int = 0) -> list[SimRequest]:
    """Chat turns and document questions interleaved at random, each chat in turn order."""
    rng = np.random.default_rng(seed)

    def toks(bounds: tuple[int, int] | int) -> np.ndarray:
        n = bounds if isinstance(bounds, int) else int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(0, shape.vocab, size=n, dtype=np.int32)

    system = toks(shape.system_tokens)
    streams: list[list[SimRequest]] = []
    for c in range(shape.chats):
        turns: list[SimRequest] = []
        history = system
        for t in range(shape.turns):
            prompt = np.concatenate([history, toks(shape.message_tokens)])
            output = toks(shape.output_tokens)
            turns.append(SimRequest(f"chat{c}-turn{t}", "chat", prompt, output))
            history = np.concatenate([prompt, output])
        streams.append(turns)
    for d in range(shape.docs):
        doc = np.concatenate([system, toks(shape.doc_tokens)])
        streams.append(
            [
                SimRequest(
                    f"doc{d}-q{q}",
                    "doc_qa",
                    np.concatenate([doc, toks(shape.question_tokens)]),
                    toks(shape.output_tokens),
                )
                for q in range(shape.questions)
            ]
        )
    order: list[SimRequest] = []
    cursors = [0] * len(streams)
    while len(order) < sum(map(len, streams)):
        live = [i for i, s in enumerate(streams) if cursors[i] < len(s)]
        i = int(rng.choice(live))
        order.append(streams[i][cursors[i]])
        cursors[i] += 1
    return order


@dataclass(frozen=True)
class Footprint:
    """How many chunks a request stream stores: distinct ones, and the longest request's."""

    distinct_chunks: int
    largest_request_chunks: int


def chunk_footprint(requests: list[SimRequest], chunk_size: int) -> Footprint:
    """The stream's full chunks (prompt and output), counted by their prefix keys.

    Sizes the demo's L1 against the workload: shared prefixes hash to the same keys,
    so `distinct_chunks` is what an L1 holding everything would hold.
    """
    seen: set[bytes] = set()
    largest = 0
    for req in requests:
        keys = chain_hashes(np.concatenate([req.prompt, req.output]), chunk_size)
        seen.update(keys)
        largest = max(largest, len(keys))
    return Footprint(len(seen), largest)
