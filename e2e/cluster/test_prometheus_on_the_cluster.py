"""Prometheus (Debian's server) scraping the fleet on the real control plane: the router's and the
engines' pods as the API server lists them (file_sd: Debian builds it without kubernetes_sd), loads the chart's recording and
alerting rules, and during load every panel query of both Grafana dashboards returns series."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvfleet.cluster import local
from kvfleet.operator.testing.chart import DASHBOARDS, RULES
from kvfleet.oslib import free_port

from .conftest import KEY, TINY, condition, eventually, items, ready_pod_ips, router_url, tenant

# Grafana's variables, as a dashboard with every model and tenant selected would send them
VARIABLES = {"$__rate_interval": "1m", "$model": ".*", "$tenant": ".*", "$__all": ".*"}


def targets(cluster: local.Cluster) -> list[dict[str, Any]]:
    """The router's and the engines' pods, as file_sd targets from the API server (Debian's
    Prometheus is built without kubernetes_sd: the same pods, the same podIP:port, found here)."""
    found = []
    for pod in items(
        cluster, "pods", "-A", "-l", "app.kubernetes.io/name in (kvfleet-router,kvfleet-engine)"
    ):
        if condition(pod, "Ready") != "True":
            continue
        port = next(
            p["containerPort"]
            for c in pod["spec"]["containers"]
            for p in c.get("ports", [])
            if p["name"] == "http"
        )
        labels = {"pod": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"]}
        found.append({"targets": [f"{pod['status']['podIP']}:{port}"], "labels": labels})
    return found


def prometheus_config(targets_file: Path) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kvfleet",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}],
            }
        ],
    }


def simulated_with_an_adapter() -> dict[str, Any]:
    """A simulated engine (no weights read) serving two LoRA adapters, with an SLO: what the LoRA and
    goodput panels need beside the tiny example."""
    manifest = local.load_yaml(TINY)
    manifest["metadata"]["name"] = "sim"
    manifest["spec"]["model"]["name"] = "sim"
    manifest["spec"]["engine"]["simulate"] = True
    manifest["spec"]["engine"]["maxLoras"] = 1  # two adapters alternating in one slot: loads and evictions
    manifest["spec"]["adapters"] = [
        {"name": name, "uri": f"file:///opt/kvfleet/models/{name}"} for name in ("sim-sql", "sim-chat")
    ]
    manifest["spec"]["slo"] = {"ttftMs": 60000, "tpotMs": 60000}
    return manifest


@pytest.fixture(scope="module")
def prometheus(tiny: local.Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (make system-deps installs it)")
    tiny.kubectl("apply", "-f", "-", stdin=json.dumps(simulated_with_an_adapter()))
    eventually(lambda: ready_pod_ips(tiny, "default", "kvfleet.dev/inferenceservice=sim"), 180, "sim Ready")
    folder = tmp_path_factory.mktemp("prometheus")
    (folder / "targets.json").write_text(json.dumps(targets(tiny)))
    (folder / "prometheus.yml").write_text(json.dumps(prometheus_config(folder / "targets.json")))
    port = free_port()
    argv = [
        binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    with (folder / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: _get(url, "/-/ready") is not None, 60, "Prometheus ready")
        yield url
    finally:
        server.terminate()
        server.wait(30)
        tiny.kubectl("delete", "kis", "sim", "-n", "default", "--wait=false")


def _get(url: str, path: str) -> Any:
    try:
        with urllib.request.urlopen(url + path, timeout=10) as answer:
            body = answer.read()
    except OSError:
        return None
    return json.loads(body) if body.startswith(b"{") else body


def query(url: str, expr: str) -> list[Any]:
    answer = _get(url, "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert answer is not None and answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def panel_queries() -> list[tuple[str, str]]:
    found = []
    for board in DASHBOARDS:
        for panel in json.loads(board.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in VARIABLES.items():
                    expr = expr.replace(name, value)
                found.append((f"{board.stem}: {panel['title']}", expr))
    return found


def load(url: str, seconds: float, outcomes: Counter[str]) -> None:
    """Requests from a paying tenant to the model, the simulated one and its adapter (some streamed),
    and from a throttled tenant (429s), for ``seconds``; ``outcomes`` counts each model's answers."""
    ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    slow = openai.OpenAI(base_url=url + "/v1", api_key="sk-prom-throttled", max_retries=0, timeout=60)
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
        for model in ("tiny", "sim", "sim-sql", "sim-chat"):
            try:
                ok.completions.create(
                    model=model, prompt=f"load {n}", max_tokens=8, stream=n % 2 == 0, temperature=0
                )
                outcomes[model] += 1
            except openai.OpenAIError as err:
                outcomes[f"{model}: {err}"] += 1
        with contextlib.suppress(openai.RateLimitError):
            slow.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_prometheus_finds_the_fleet_and_every_panel_query_returns_series(
    tiny: local.Cluster, prometheus: str
) -> None:
    for obj in tenant("prom-throttled", "sk-prom-throttled", requestsPerMinute=1):
        tiny.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    url = router_url(tiny)
    outcomes: Counter[str] = Counter()
    eventually(
        lambda: (
            {"sim", "sim-sql", "sim-chat"}
            <= {m.id for m in openai.OpenAI(base_url=url + "/v1", api_key=KEY).models.list().data}
        ),
        60,
        "the router serves sim and its adapters",
    )
    worker = threading.Thread(target=load, args=(url, 45, outcomes), daemon=True)
    worker.start()

    def scraped() -> set[str]:
        return {r["metric"]["pod"].rsplit("-", 2)[0] for r in query(prometheus, "up == 1")}

    jobs = eventually(lambda: {"kvfleet-router", "tiny", "sim"} <= scraped() and scraped(), 60, "targets up")
    assert {"kvfleet-router", "tiny", "sim"} <= jobs, jobs
    time.sleep(30)  # several scrapes and rule evaluations under load
    empty = [(title, expr) for title, expr in panel_queries() if not query(prometheus, expr)]
    worker.join(60)
    assert all(outcomes[m] > 0 for m in ("tiny", "sim", "sim-sql", "sim-chat")), (
        outcomes
    )  # every model answered
    assert empty == [], "\n".join(f"{t}: {e}" for t, e in empty)


def test_the_charts_rules_load_and_evaluate_in_the_real_server(prometheus: str) -> None:
    groups = eventually(
        lambda: (_get(prometheus, "/api/v1/rules") or {}).get("data", {}).get("groups"), 30, "rules"
    )
    rules = [r for g in groups for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
    ]
    assert {r["type"] for r in rules} == {"recording", "alerting"}
