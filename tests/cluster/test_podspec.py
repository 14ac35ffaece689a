"""A pod spec → the process the process node launches (kvfleet/cluster/podspec.py): pure, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.cluster.podspec import (
    ConfigError,
    NodeSettings,
    PodFolders,
    container_env,
    container_port,
    expand,
    field_ref,
    grace_seconds,
    launch_plan,
    map_path,
    restart_policy,
)

SECRETS = {"creds": {"token": "s3cret", "user": "ann"}}
CONFIGMAPS = {"conf": {"level": "debug", "mode": "fast"}}


def lookup(kind: str, name: str) -> dict[str, str] | None:
    return (SECRETS if kind == "secret" else CONFIGMAPS).get(name)


def a_pod(**container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "web-1", "namespace": "team", "uid": "u-1", "labels": {"app": "web"}},
        "spec": {
            "nodeName": "kvfleet-process",
            "serviceAccountName": "robot",
            "containers": [{"name": "c", **container}],
        },
        "status": {"podIP": "127.1.0.7", "hostIP": "127.0.0.1"},
    }


SETTINGS = NodeSettings(
    bin_dir="/venv/bin",
    system_path="/usr/bin:/bin",
    path_map={"/opt/kvfleet/models": "/local/models"},
    shim="/s/bindshim.so",
    kubelet_pid=42,
)
FOLDERS = PodFolders(
    volumes={"cache": "/pods/p/volumes/cache", "tmp": "/pods/p/volumes/tmp"},
    home="/pods/p/home",
    kubeconfig="/pods/p/kubeconfig",
)


def test_a_defined_variable_expands_an_undefined_one_stays_and_a_double_dollar_escapes() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(C) and $(A", env) == "$(C) and $(A"
    assert expand("$$(A) costs $5", env) == "$(A) costs $5"


def test_a_fieldref_env_resolves_to_the_pod_name_namespace_uid_label_ip_node_and_account() -> None:
    pod = a_pod()
    paths = [
        "metadata.name",
        "metadata.namespace",
        "metadata.uid",
        "metadata.labels['app']",
        "status.podIP",
        "spec.nodeName",
        "spec.serviceAccountName",
    ]
    assert [field_ref(pod, p) for p in paths] == [
        "web-1",
        "team",
        "u-1",
        "web",
        "127.1.0.7",
        "kvfleet-process",
        "robot",
    ]
    assert field_ref(pod, "metadata.labels['absent']") == ""


def test_env_takes_envfrom_first_then_env_in_order_each_value_expanded_against_the_earlier_ones() -> None:
    container = {
        "envFrom": [{"configMapRef": {"name": "conf"}, "prefix": "CFG_"}, {"secretRef": {"name": "creds"}}],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "URL", "value": "http://$(user):$(token)@$(POD)/$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "user", "value": "bob"},
            {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "level"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        ],
    }
    env = container_env(a_pod(), container, lookup)
    assert env["URL"] == "http://ann:s3cret@web-1/$(LATER)"
    assert env["user"] == "bob" and env["CFG_mode"] == "fast"
    assert (env["LEVEL"], env["TOKEN"]) == ("debug", "s3cret")


def test_a_missing_optional_key_is_left_out_and_a_missing_required_one_is_a_config_error() -> None:
    optional = {
        "env": [
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "nope", "optional": True}}}
        ]
    }
    optional["envFrom"] = [{"configMapRef": {"name": "absent", "optional": True}}]
    assert container_env(a_pod(), optional, lookup) == {}
    with pytest.raises(ConfigError, match="absent"):
        container_env(
            a_pod(),
            {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k"}}}]},
            lookup,
        )
    with pytest.raises(ConfigError):
        container_env(a_pod(), {"envFrom": [{"secretRef": {"name": "absent"}}]}, lookup)


def test_a_mapped_path_and_what_lies_under_it_are_rewritten_and_nothing_else_is() -> None:
    mapping = {
        "/opt/kvfleet/models": "/local/models",
        "/opt/kvfleet/models/big": "/big",
        "/tmp": "/pods/p/tmp",
    }
    assert map_path("/opt/kvfleet/models", mapping) == "/local/models"
    assert map_path("/opt/kvfleet/models/tiny/config.json", mapping) == "/local/models/tiny/config.json"
    assert map_path("/opt/kvfleet/models/big/x", mapping) == "/big/x"  # the longest mapped path wins
    assert map_path("/opt/kvfleet/modelsX", mapping) == "/opt/kvfleet/modelsX"
    assert map_path("--model=/tmp/m", mapping) == "--model=/pods/p/tmp/m"
    assert map_path("relative/tmp", mapping) == "relative/tmp"


def test_the_launch_plan_maps_mounts_and_the_path_map_into_argv_env_and_working_dir() -> None:
    pod = a_pod(
        command=["kvfleet", "engine"],
        args=["--model", "/opt/kvfleet/models/tiny", "--name", "$(POD)", "--scratch", "/var/cache/kvfleet/x"],
        env=[
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "DATA", "value": "/tmp/data"},
        ],
        workingDir="/tmp/work",
        volumeMounts=[
            {"name": "cache", "mountPath": "/var/cache/kvfleet"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    )
    plan = launch_plan(pod, pod["spec"]["containers"][0], lookup, FOLDERS, SETTINGS)
    assert plan.argv == [
        "kvfleet",
        "engine",
        "--model",
        "/local/models/tiny",
        "--name",
        "web-1",
        "--scratch",
        "/pods/p/volumes/cache/x",
    ]
    assert plan.cwd == "/pods/p/volumes/tmp/work"
    env = plan.env
    assert env["PATH"] == "/venv/bin:/usr/bin:/bin"
    assert env["HOME"] == env["KVFLEET_CACHE"] == "/pods/p/volumes/cache"
    assert (env["TMPDIR"], env["DATA"], env["PYTHONUNBUFFERED"]) == (
        "/pods/p/volumes/tmp",
        "/pods/p/volumes/tmp/data",
        "1",
    )
    assert (env["KVFLEET_POD_IP"], env["LD_PRELOAD"], env["KUBECONFIG"]) == (
        "127.1.0.7",
        "/s/bindshim.so",
        "/pods/p/kubeconfig",
    )
    assert env["KVFLEET_KUBELET_PID"] == "42" and "KUBERNETES_SERVICE_HOST" not in env


def test_without_a_cache_mount_home_is_the_pod_folder_pod_env_overrides_and_the_entrypoint_is_kvfleet() -> (
    None
):
    pod = a_pod(
        args=["router", "--port", "8080"],
        env=[{"name": "PYTHONUNBUFFERED", "value": "0"}, {"name": "KVFLEET_POD_IP", "value": "1.2.3.4"}],
    )
    plan = launch_plan(pod, pod["spec"]["containers"][0], lookup, FOLDERS, SETTINGS)
    assert plan.argv == ["kvfleet", "router", "--port", "8080"]
    assert plan.env["HOME"] == plan.env["KVFLEET_CACHE"] == plan.cwd == "/pods/p/home"
    assert "TMPDIR" not in plan.env and plan.env["PYTHONUNBUFFERED"] == "0"
    assert plan.env["KVFLEET_POD_IP"] == "127.1.0.7"  # the node's, whatever the pod says


def test_a_subpath_mount_maps_to_the_folder_inside_its_volume() -> None:
    pod = a_pod(
        command=["cat", "/etc/app/conf.yaml"],
        volumeMounts=[{"name": "cache", "mountPath": "/etc/app", "subPath": "app"}],
    )
    plan = launch_plan(pod, pod["spec"]["containers"][0], lookup, FOLDERS, SETTINGS)
    assert plan.argv == ["cat", "/pods/p/volumes/cache/app/conf.yaml"]


def test_restart_policy_grace_and_named_ports_come_from_the_spec_with_kubernetes_defaults() -> None:
    pod = a_pod(ports=[{"name": "http", "containerPort": 8000}])
    container = pod["spec"]["containers"][0]
    assert restart_policy(pod) == "Always" and restart_policy(pod, {"restartPolicy": "Always"}) == "Always"
    assert grace_seconds(pod) == 30
    pod["spec"]["terminationGracePeriodSeconds"] = 5
    assert grace_seconds(pod) == 5
    pod["metadata"]["deletionGracePeriodSeconds"] = 0
    assert grace_seconds(pod) == 0
    assert (
        container_port(container, "http"),
        container_port(container, 9000),
        container_port(container, "81"),
    ) == (8000, 9000, 81)
    with pytest.raises(ConfigError):
        container_port(container, "metrics")
