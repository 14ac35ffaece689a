"""The Helm chart as real Helm renders it (helm-python-sdk: Helm's Go SDK, no binary), for tests.

Also the one list of metric names the chart's dashboards and rules use, for checking them
against what the engine and router really export (:func:`chart_metric_names`).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import helm_python as helm
import yaml

from .crdschema import ROOT

CHART = ROOT / "charts" / "kvfleet"
DASHBOARDS = sorted((CHART / "files" / "dashboards").glob("*.json"))
RULES = CHART / "files" / "prometheus" / "kvfleet-rules.yaml"

# Histogram series carry these suffixes; the metric is the name without them.
_SUFFIXES = ("_bucket", "_sum", "_count")
# kvfleet_* (the processes' own), kvfleet:lora_* and vllm:* (the engines' LoRA names, as vLLM spells them);
# other kvfleet:* names are the rules' recorded series.
METRIC_NAME = r"(?:kvfleet_|kvfleet:lora_|vllm:)[a-z0-9_]+"
_NAME = re.compile(rf"\b{METRIC_NAME}")
# The engines' LoRA metrics (the real engine and the simulator export the same), as vLLM and kvfleet name them.
LORA_METRICS = frozenset({
    "vllm:lora_requests_info",
    "kvfleet:lora_requests_total",
    "kvfleet:lora_tokens_total",
    "kvfleet:lora_loads_total",
    "kvfleet:lora_evictions_total",
    "kvfleet:lora_resident",
})  # fmt: skip


def render(values: dict[str, Any] | None = None, namespace: str = "kvfleet-system") -> list[dict[str, Any]]:
    """Every object the chart's templates render (CRDs are in crds/, not templates); a fresh copy."""
    return copy.deepcopy(_render(json.dumps(values or {}, sort_keys=True), namespace))


@functools.cache
def _render(values: str, namespace: str) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(json.loads(values), name="kvf", namespace=namespace)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def lint() -> dict[str, Any]:
    return dict(helm.lint(str(CHART)))


def _metric(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def expressions() -> list[str]:
    """Every PromQL expression of the dashboards and the rules."""
    exprs = [t["expr"] for d in DASHBOARDS for p in json.loads(d.read_text())["panels"] for t in p["targets"]]
    exprs += [
        v["query"]
        for d in DASHBOARDS
        for v in json.loads(d.read_text())["templating"]["list"]
        if "query" in v
    ]
    exprs += [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return exprs


def chart_metric_names() -> set[str]:
    """The kvfleet_*, kvfleet:lora_* and vllm:* metric names (histograms without _bucket/_sum/_count)
    the chart queries. Other recorded series (``kvfleet:router_...``) are the chart's own and not counted."""
    return {_metric(m) for e in expressions() for m in _NAME.findall(e)}
