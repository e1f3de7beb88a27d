"""dashboards/kvflow.json, proven against a real server scraped by the real Prometheus binary.

A `kvflow server` subprocess (L2 on disk, every GPU block sampled) gets two rounds of
traffic that move every metric the dashboard reads; Prometheus scrapes it every
second; then every panel's PromQL, with its template variables replaced by the values
the dashboard's own variable queries return, is evaluated through /api/v1/query. A
query that errors or returns no series fails the test, so a renamed metric cannot
leave a panel blank unnoticed.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvflow.core import KVFlowClient
from tests.observe.traffic import MODEL, Workload, observed_server
from tests.support.collectors import PrometheusServer

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DASHBOARD = DASHBOARDS / "kvflow.json"
#: what Grafana puts for its interval variables; rates need two scrapes (1 s apart) in range
GRAFANA_INTERVALS = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m"}
METRIC = re.compile(r"\bkvflow_[a-z0-9_]+")

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the Debian package prometheus is not installed (`make pytest` installs it)",
)


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every non-row panel, also those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _substitute(expr: str, values: dict[str, str]) -> str:
    """The expression as Grafana sends it: interval and template variables replaced."""
    for name, value in {**GRAFANA_INTERVALS, **values}.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown variable left in {expr!r}"
    return expr


def test_the_dashboard_is_well_formed() -> None:
    """Current schema, a Prometheus datasource variable that every panel and target uses,
    instance and model filters, the five rows, and targets on every panel."""
    dash = _dashboard()
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"] == "kvflow"
    variables = _variables(dash)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "model"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    for word in ("Health", "effectiveness", "Capacity", "Throughput", "lifecycle"):
        assert any(word in row for row in rows), f"no row about {word}: {rows}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in _panels(dash):
        assert panel.get("targets"), f"panel {panel['title']!r} has no targets"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert METRIC.search(target["expr"]), f"{panel['title']!r}: {target['expr']!r}"
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])


def test_the_provisioning_files_point_at_the_dashboard() -> None:
    """The provider reads a folder of dashboards; the datasource is a Prometheus one."""
    provider = (DASHBOARDS / "provisioning" / "dashboards" / "kvflow.yaml").read_text()
    assert "type: file" in provider and "path:" in provider
    source = (DASHBOARDS / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    assert "type: prometheus" in source and "url:" in source


@dataclass
class Scraped:
    """A server with traffic behind a Prometheus that has scraped it."""

    prometheus: PrometheusServer
    metrics_text: str
    target: str


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """Two rounds of traffic a few scrapes apart, so every rate has a non-trivial window."""
    tmp = tmp_path_factory.mktemp("dashboard")
    with observed_server(tmp) as server, KVFlowClient(server.endpoint) as client:
        target = f"127.0.0.1:{server.metrics_port}"
        prometheus = PrometheusServer([target])
        try:
            prometheus.wait_ready()
            prometheus.wait_for('up{job="kvflow"} == 1')
            workload = Workload(client)
            workload.drive()
            time.sleep(2.5)
            workload.drive()
            # both rounds' block evictions are in a scrape, and one more scrape after it
            prometheus.wait_for("sum(kvflow_l0_block_reuse_gap_seconds_count) >= 16")
            time.sleep(1.5)
            url = f"http://{target}/metrics"
            with urllib.request.urlopen(url, timeout=5.0) as reply:
                text = reply.read().decode()
            yield Scraped(prometheus, text, target)
        finally:
            prometheus.close()


def _regex_escape(value: str) -> str:
    """A single selected value as Grafana's Prometheus datasource puts it in `=~"..."`:
    regex metacharacters escaped, the backslash doubled for the PromQL string."""
    return re.sub(r"[$^*{}\[\]'+?.()|\\]", lambda m: "\\\\" + m.group(0), value)


def _label_values(prometheus: PrometheusServer, query: str) -> list[str]:
    """What Grafana's `label_values(selector, label)` variable query returns."""
    match = re.fullmatch(r"label_values\((.+), *(\w+)\)", query)
    assert match, f"unexpected variable query {query!r}"
    selector, label = match.groups()
    url = f"{prometheus.url}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
        {"match[]": selector}
    )
    with urllib.request.urlopen(url, timeout=5.0) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    values: list[str] = body["data"]
    return values


@needs_prometheus
def test_every_target_names_only_scraped_metrics(scraped: Scraped) -> None:
    """Each kvflow_* name in a target is a series name of the server's real /metrics."""
    names = {
        line.split("{")[0].split(" ")[0]
        for line in scraped.metrics_text.splitlines()
        if line and not line.startswith("#")
    }
    missing = {}
    for panel in _panels(_dashboard()):
        for target in panel["targets"]:
            for metric in METRIC.findall(target["expr"]):
                if metric not in names:
                    missing[metric] = panel["title"]
    assert not missing, f"metrics the server does not export: {missing}"


@needs_prometheus
def test_every_panel_query_returns_series(scraped: Scraped) -> None:
    """The variable queries find this server and model; every target, with them
    substituted, evaluates without error to at least one series."""
    dash = _dashboard()
    variables = _variables(dash)
    values: dict[str, str] = {}
    for name, want in (("instance", scraped.target), ("model", MODEL)):
        query = variables[name]["definition"]
        query = query.replace("$instance", values.get("$instance", ".*"))
        found = _label_values(scraped.prometheus, query)
        assert want in found, f"variable {name}: {query!r} gave {found}"
        values[f"${name}"] = _regex_escape(want)
    failures = []
    evaluated = 0
    for panel in _panels(dash):
        for target in panel["targets"]:
            expr = _substitute(target["expr"], values)
            try:
                result = scraped.prometheus.query(expr)
            except Exception as exc:  # an HTTP 400 is a PromQL error
                failures.append(f"{panel['title']!r} {target['refId']}: {expr}\n  error: {exc}")
                continue
            evaluated += 1
            if not result:
                failures.append(f"{panel['title']!r} {target['refId']}: {expr}\n  no series")
    assert not failures, "\n".join(failures)
    assert evaluated >= 60
    # the headline numbers are real, not just present
    for title in ("Token hit rate", "Blend hit rate"):
        (hit,) = scraped.prometheus.query(_substitute(_panel_expr(dash, title), values))
        assert 0.0 < float(hit["value"][1]) <= 1.0, title


def _panel_expr(dash: dict[str, Any], title: str) -> str:
    (panel,) = [p for p in _panels(dash) if p["title"] == title]
    expr: str = panel["targets"][0]["expr"]
    return expr
