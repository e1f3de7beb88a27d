"""Admin operations under load, and tenant isolation (docs/OPERATIONS.md; issue 42).

Real `kvflow server` processes and clients in threads of this process sharing CPU KV
caches. While three engines store and retrieve, an operator clears, shrinks and grows
L1, drains and undrains, and sets a quota: every byte a retrieve returns is the byte
its prompt stored, stores are refused only while draining, nothing else fails. A noisy
tenant storing 10x its quota leaves another tenant's hot prefixes in L1.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable

import torch

from kvflow.core import KVFlowClient
from kvflow.core.errors import DrainingError
from kvflow.core.server.protocol import AdminClear, AdminDrain, AdminQuota, AdminResize
from tests.support.collectors import free_port
from tests.support.ops import BLOCKS_PER_CHUNK, BS, CHUNK, NB, ServerProcess, shared_kv, tokens

PROMPT_CHUNKS = 2
SRC = range(0, PROMPT_CHUNKS * BLOCKS_PER_CHUNK)
DST = range(NB // 2, NB // 2 + PROMPT_CHUNKS * BLOCKS_PER_CHUNK)


def _pattern(seed: int, like: torch.Tensor) -> torch.Tensor:
    """The KV a prompt's blocks hold when it is stored: its own, so a mix-up shows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, len(SRC), *like.shape[2:])
    return torch.randn(shape, generator=gen).to(like.dtype)


class _Engine(threading.Thread):
    """One engine: stores prompts (each with its own KV) and retrieves them into other
    blocks, checking every retrieved block against what that prompt stored."""

    def __init__(self, endpoint: str, n: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.n, self.stop = endpoint, n, stop
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []

    def run(self) -> None:
        kv = shared_kv(100 + self.n)
        iid, model = f"load-{self.n}", f"model-{self.n}"
        with KVFlowClient(self.endpoint, timeout_s=30) as client:
            client.register_kv_caches(iid, kv, model_name=model)
            i = 0
            while not self.stop.is_set():
                seed = self.n * 1000 + i % 24
                prompt = tokens(PROMPT_CHUNKS * CHUNK, seed=seed)
                salt = "even" if seed % 2 == 0 else "odd"
                for layer in kv:
                    layer[:, SRC.start : SRC.stop] = _pattern(seed, layer)
                try:
                    client.store(iid, prompt, list(SRC), request_id=f"s{i}", cache_salt=salt)
                    self.counts["stored"] += 1
                except DrainingError:
                    self.counts["refused_draining"] += 1
                except Exception as exc:
                    self.errors.append(f"store: {type(exc).__name__}: {exc}")
                try:
                    hit = client.retrieve(
                        iid, prompt, list(DST), request_id=f"r{i}", cache_salt=salt
                    )
                    self._check(kv, seed, hit)
                except Exception as exc:
                    self.errors.append(f"retrieve: {type(exc).__name__}: {exc}")
                client.end_session(f"s{i}")
                client.end_session(f"r{i}")
                i += 1
            client.unregister(iid)

    def _check(self, kv: list[torch.Tensor], seed: int, hit_tokens: int) -> None:
        blocks = hit_tokens // BS
        self.counts["retrieved_blocks"] += blocks
        self.counts["retrieves_with_hits"] += bool(blocks)
        for layer in kv:
            want = _pattern(seed, layer)[:, :blocks]
            if not torch.equal(layer[:, DST.start : DST.start + blocks], want):
                self.errors.append(f"retrieve of prompt {seed}: bytes differ")
                return


def test_clear_resize_drain_and_quota_under_load() -> None:
    srv = ServerProcess("--disable-metrics", "--l1-size-gb", "0.01")
    stop = threading.Event()
    engines = [_Engine(srv.endpoint, n, stop) for n in range(3)]
    try:
        for engine in engines:
            engine.start()
        with KVFlowClient(srv.endpoint, timeout_s=30) as op:
            steps: list[Callable[[], object]] = [
                lambda: op.admin(AdminClear(model_name="model-0")),
                lambda: op.admin(AdminResize(l1_size_gb=0.004)),
                lambda: op.admin(AdminClear(cache_salt="odd")),
                lambda: op.admin(AdminResize(l1_size_gb=0.02)),
                lambda: op.admin(AdminQuota(kind="model", name="model-1", limit_gb=0.0005)),
                lambda: op.admin(AdminClear(everything=True, tiers=["l1"])),
                lambda: op.admin(AdminQuota(kind="model", name="model-1", limit_gb=None)),
            ]
            for step in steps:
                time.sleep(0.4)
                step()
            time.sleep(0.4)
            drain = op.admin(AdminDrain())
            while not drain["drained"]:  # in-flight stores finish, then it is drained
                time.sleep(0.05)
                drain = op.status()["server"]["drain"]
            refused_before = sum(e.counts["refused_draining"] for e in engines)
            time.sleep(0.5)
            op.admin(AdminDrain(undrain=True))
            time.sleep(0.8)
            stop.set()
            for engine in engines:
                engine.join(60)
            status = op.status()
    finally:
        stop.set()
        code = srv.stop()
    assert code == 0, srv.log()
    print("engines:", [dict(e.counts) for e in engines])
    for engine in engines:
        assert not engine.errors, engine.errors[:5]
        assert engine.counts["stored"] > 10 and engine.counts["retrieves_with_hits"] > 10
    assert sum(e.counts["refused_draining"] for e in engines) > refused_before >= 0
    assert sum(e.counts["refused_draining"] for e in engines) > 0
    l1 = status["l1"]
    assert l1["capacity_bytes"] == int(0.02 * (1 << 30))
    assert l1["usage_bytes"] <= l1["capacity_bytes"] and l1["writing"] == 0
    assert status["server"]["drain"] == {
        "draining": False, "in_flight": 0, "pending_l2_writes": 0, "drained": False,
    }  # fmt: skip
    log = srv.log()
    for action in ("clear", "resize", "quota", "drain"):
        assert f"admin {action} " in log


NOISY_QUOTA_GB = 0.001  # 32 chunks of 32 KiB
HOT_PROMPTS, CHUNKS_PER_STORE = 8, 4


def _hot_hit_rate(flags: tuple[str, ...]) -> float:
    """A hot tenant's 8 prompts (32 chunks) stored once; then twice over, a noisy tenant
    stores 160 chunks (320 in all: 10x its quota of 32, 2.5x the whole 4-MiB L1) and the
    hot tenant looks its prompts up. Returns the hot tenant's lookup hit rate (tokens)."""
    metrics_port = free_port()
    srv = ServerProcess("--l1-size-gb", "0.004", "--prometheus-port", str(metrics_port), *flags)
    try:
        with KVFlowClient(srv.endpoint, timeout_s=30) as client:
            client.register_kv_caches("hot", shared_kv(1), model_name="m")
            client.register_kv_caches("noisy", shared_kv(2), model_name="m")
            blocks = list(range(CHUNKS_PER_STORE * BLOCKS_PER_CHUNK))
            n_tokens = CHUNKS_PER_STORE * CHUNK
            hot = [tokens(n_tokens, seed=s) for s in range(HOT_PROMPTS)]
            for i, prompt in enumerate(hot):
                assert client.store("hot", prompt, blocks, request_id=f"h{i}", cache_salt="hot")
            requested = hit = 0
            for rnd in range(2):
                for j in range(40):
                    prompt = tokens(n_tokens, seed=10_000 + rnd * 100 + j)
                    client.store("noisy", prompt, blocks, request_id=f"n{rnd}-{j}",
                                 cache_salt="noisy")  # fmt: skip
                for prompt in hot:
                    requested += n_tokens
                    hit += client.lookup(prompt, model_name="m", cache_salt="hot")
            tenants = {t["tenant"]: t for t in client.status()["server"]["tenants"]}
            if flags:
                noisy = next(t for t in tenants.values() if t["limit_bytes"])
                assert noisy["usage_bytes"] <= int(NOISY_QUOTA_GB * (1 << 30))
                assert noisy["evicted_chunks"] >= 320 - 32
                _check_tenant_metrics(metrics_port, noisy["tenant"], noisy["usage_bytes"])
        return hit / requested
    finally:
        assert srv.stop() == 0, srv.log()


def _check_tenant_metrics(port: int, label: str, usage: int) -> None:
    """/metrics shows the noisy tenant under its hashed label (never the salt itself) with
    its usage, limit and evictions, and the hot tenant's lookups. Values are parsed as
    numbers: the exporter writes large gauges in exponent form (1.048576e+06)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    tenant = f'kind="salt",tenant="{label}"'
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(values[f"kvflow_tenant_usage_bytes{{{tenant}}}"]) == usage
    assert f"kvflow_tenant_limit_bytes{{{tenant}}}" in text
    assert f"kvflow_tenant_evicted_chunks_total{{{tenant}}}" in text
    assert "kvflow_tenant_lookup_hit_tokens_total" in text
    assert 'tenant="noisy"' not in text and 'tenant="hot"' not in text  # salts stay hidden


def test_a_noisy_tenant_at_10x_its_quota_leaves_another_tenants_hot_set() -> None:
    """With --l1-quota salt:noisy=0.001 the hot tenant keeps every lookup hit (rate
    1.00); the same workload without the quota wipes its hot set (rate 0.00)."""
    with_quota = _hot_hit_rate(("--l1-quota", f"salt:noisy={NOISY_QUOTA_GB}"))
    without = _hot_hit_rate(())
    print(f"hot tenant hit rate: {with_quota:.2f} with the quota, {without:.2f} without")
    assert with_quota == 1.0
    assert without <= 0.25
