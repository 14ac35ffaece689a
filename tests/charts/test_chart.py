"""The Helm chart through real Helm: lint, render, validate; CRDs equal to crds/; dashboards and
rules only use the metric names of docs/architecture.md §8, checked by promtool."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvfleet.operator.testing.chart import (
    CHART,
    DASHBOARDS,
    LORA_METRICS,
    RULES,
    chart_metric_names,
    expressions,
    lint,
    render,
)
from kvfleet.operator.testing.crdschema import CRD_DIR, admit, load_crds

K8S = "1.35"
# docs/architecture.md §8: every name the engine and the router export.
DESIGN_METRICS = {
    "kvfleet_engine_time_to_first_token_seconds",
    "kvfleet_engine_time_per_output_token_seconds",
    "kvfleet_engine_inter_token_latency_seconds",
    "kvfleet_engine_e2e_request_latency_seconds",
    "kvfleet_engine_queue_time_seconds",
    "kvfleet_engine_num_requests_running",
    "kvfleet_engine_num_requests_waiting",
    "kvfleet_engine_kv_cache_usage_ratio",
    "kvfleet_engine_prompt_tokens_total",
    "kvfleet_engine_generation_tokens_total",
    "kvfleet_engine_preemptions_total",
    "kvfleet_engine_prefix_cache_queries_total",
    "kvfleet_engine_prefix_cache_hits_total",
    "kvfleet_router_requests_total",
    "kvfleet_router_rejections_total",
    "kvfleet_router_queue_depth",
    "kvfleet_router_queue_wait_seconds",
    "kvfleet_router_time_to_first_token_seconds",
    "kvfleet_router_time_per_output_token_seconds",
    "kvfleet_router_inter_token_latency_seconds",
    "kvfleet_router_prompt_tokens_total",
    "kvfleet_router_generation_tokens_total",
    "kvfleet_router_slo_requests_total",
    "kvfleet_router_sli_events_total",  # issue #32: the TTFT and ITL SLIs apart (docs/architecture.md §8)
    "kvfleet_router_adapter_requests_total",
    "kvfleet_router_adapter_tokens_total",
} | LORA_METRICS
CUSTOM_KINDS = {"PrometheusRule", "ClusterKopfPeering", "KopfPeering"}
NAMESPACED = {
    "operator": {"watchNamespaces": ["team-a", "team-b"]},
    "monitoring": {"rulesConfigMap": {"enabled": True}},
}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path is not None, "promtool is missing: `make system-deps` installs Debian's prometheus"
    return path


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lints_the_chart_without_warnings() -> None:
    result = lint()
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []


# The PrometheusRule renders by default only where the cluster serves its CRD (`auto`): Helm's SDK
# renders without a cluster, so the tests of the rule turn it on.
RULE_ON = {"monitoring": {"prometheusRule": {"enabled": True}}}


def test_the_prometheusrule_renders_only_where_the_cluster_serves_it_unless_forced() -> None:
    assert by_kind(render(), "PrometheusRule") == []
    assert len(by_kind(render(RULE_ON), "PrometheusRule")) == 1
    assert by_kind(render({"monitoring": {"prometheusRule": {"enabled": False}}}), "PrometheusRule") == []


def test_the_charts_crds_are_byte_identical_to_crds() -> None:
    ours = {p.name: p.read_bytes() for p in sorted(CRD_DIR.glob("*.yaml"))}
    charts = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert charts == ours, "run: cp crds/*.yaml charts/kvfleet/crds/"


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["all-namespaces", "two-namespaces"])
def test_every_rendered_object_is_valid_kubernetes(values: dict[str, Any]) -> None:
    docs = render(values | RULE_ON)
    crds = load_crds()
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS - {"PrometheusRule"}:
            assert admit(crds[doc["kind"].lower() + "s"], doc)[1] == []
        elif doc["kind"] != "PrometheusRule":
            kubernetes_validate.validate(doc, K8S, strict=True)
    kinds = sorted({d["kind"] for d in docs})
    assert {"Deployment", "Service", "ClusterRole", "ServiceAccount", "ConfigMap", "PrometheusRule"} <= set(
        kinds
    )


def test_the_operator_watches_all_namespaces_or_exactly_the_listed_ones() -> None:
    def args(values: dict[str, Any]) -> list[str]:
        (dep,) = [d for d in by_kind(render(values), "Deployment") if d["metadata"]["name"] == "kvf-operator"]
        return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])

    assert args({})[0] == "--all-namespaces"
    assert args(NAMESPACED)[:2] == ["--namespace=team-a", "--namespace=team-b"]
    assert [a for a in args({}) if a.startswith("--engine-image")] == [
        "--engine-image-cpu=kvfleet-engine-cpu:0.1.0",
        "--engine-image-cuda=kvfleet-engine-cuda:0.1.0",
    ]
    mine = {"image": {"registry": "reg.example/team/"}, "operator": {"engineImage": "one:2"}}
    assert [a for a in args(mine) if a.startswith("--engine-image")] == [
        "--engine-image=one:2",
        "--engine-image-cpu=reg.example/team/kvfleet-engine-cpu:0.1.0",
        "--engine-image-cuda=reg.example/team/kvfleet-engine-cuda:0.1.0",
    ]
    peerings = [
        (d["kind"], d["metadata"].get("namespace")) for d in render(NAMESPACED) if "Peering" in d["kind"]
    ]
    assert peerings == [("KopfPeering", "team-a"), ("KopfPeering", "team-b")]
    assert [d["kind"] for d in render({}) if "Peering" in d["kind"]] == ["ClusterKopfPeering"]


def test_the_router_runs_in_kubernetes_mode_on_its_port_on_every_address_of_its_pod() -> None:
    (dep,) = [
        d
        for d in by_kind(render({"router": {"redisURL": "redis://r:6379"}}), "Deployment")
        if "router" in d["metadata"]["name"]
    ]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] + container["args"] == [
        "kvfleet", "router", "--kubernetes", "--host=0.0.0.0", "--port=8080", "--redis=redis://r:6379",
    ]  # fmt: skip


@pytest.mark.parametrize("shared", [False, True])
def test_the_router_shares_the_prefix_cache_across_tenants_only_when_the_value_says(shared: bool) -> None:
    from kvfleet.cli import build_parser
    from kvfleet.router.cli import config_from_args

    (dep,) = [
        d
        for d in by_kind(render({"router": {"sharedPrefixCache": shared}}), "Deployment")
        if "router" in d["metadata"]["name"]
    ]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    config = config_from_args(build_parser(only="router").parse_args(["router", *args]))
    assert config.shared_prefix_cache is shared  # type: ignore[attr-defined]


def test_dashboards_and_rules_use_only_the_metric_names_of_the_design() -> None:
    used = chart_metric_names()
    assert used - DESIGN_METRICS == set()
    assert DESIGN_METRICS - used == set()  # and every exported signal is shown or alerted on


def test_the_service_level_dashboard_shows_each_signal_per_model_and_tenant() -> None:
    board = json.loads((CHART / "files" / "dashboards" / "kvfleet-service-levels.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert titles == [
        "Time to first token",
        "Time per output token",
        "Inter-token latency",
        "Goodput (requests meeting the SLO)",
        "Requests by status code",
        "Rejections by reason",
        "Queue depth",
        "Queue wait",
        "Tokens per second by tenant",
        "Requests per LoRA adapter by tenant",
        "Tokens per LoRA adapter by tenant",
        "SLO error budget (objective 99% over 30 days)",
        "Error budget left: TTFT and inter-token latency (spec.slo)",
        "Error budget left: availability (non-5xx)",
    ]
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "model", "tenant"]
    router_exprs = [
        t["expr"]
        for p in board["panels"]
        for t in p["targets"]
        if "kvfleet_router_queue_depth" not in t["expr"]
    ]
    by_model = ('model=~"$model"', 'adapter=~"$model"')  # an adapter is the model its requests name
    assert all('tenant=~"$tenant"' in e and any(m in e for m in by_model) for e in router_exprs)


def test_engine_series_are_selected_by_model_name_as_the_engine_labels_them() -> None:
    board = json.loads((CHART / "files" / "dashboards" / "kvfleet-engines.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert all('model_name=~"$model"' in e for e in exprs if ":lora_" not in e)  # adapters: by adapter
    assert sum(":lora_" in e for e in exprs) == 6
    assert all("model_name" in e for e in expressions() if "kvfleet_engine_" in e and "histogram" not in e)


def test_each_dashboard_is_shipped_as_a_grafana_configmap() -> None:
    maps = [d for d in by_kind(render(), "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    assert sorted(maps[i]["metadata"]["name"] for i in range(len(maps))) == [
        "kvf-dashboard-kvfleet-engines",
        "kvf-dashboard-kvfleet-service-levels",
    ]
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "files" / "dashboards" / name).read_text())
    assert len(DASHBOARDS) == 2 and expressions()


def test_promtool_accepts_the_rules_as_shipped_and_as_rendered(tmp_path: Path) -> None:
    (rule,) = by_kind(render(RULE_ON), "PrometheusRule")
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(json.dumps(rule["spec"]))
    out = subprocess.run(
        [promtool(), "check", "rules", str(RULES), str(rendered)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS: 32 rules found") == 2


def test_promtool_unit_tests_of_the_alerts_pass(tmp_path: Path) -> None:
    shutil.copy(RULES, tmp_path / RULES.name)
    shutil.copy(Path(__file__).with_name("kvfleet-rules.test.yaml"), tmp_path / "rules.test.yaml")
    out = subprocess.run(
        [promtool(), "test", "rules", "rules.test.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_otel_values_become_the_routers_otel_variables_and_usage_log_its_flag() -> None:
    values = {"otel": {"endpoint": "http://collector:4317", "protocol": "grpc"}, "router": {"usageLog": "-"}}
    (router,) = [d for d in by_kind(render(values), "Deployment") if "router" in d["metadata"]["name"]]
    container = router["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "kvfleet-router"}  # fmt: skip
    assert "--usage-log=-" in container["args"]
    (plain,) = [d for d in by_kind(render(), "Deployment") if "router" in d["metadata"]["name"]]
    assert "env" not in plain["spec"]["template"]["spec"]["containers"][0]  # off by default
