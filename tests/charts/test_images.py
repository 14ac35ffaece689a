"""The images the chart and the operator run are the ones `make images` builds (issue #12).

Without building anything: every image reference the chart renders, and the engine images the
operator renders from the chart's flags, name an image of images/images.json (what images/build.sh
builds) with the package version as tag; each pod's user, command and ports are what that image's
Containerfile stage sets, and its writable paths (read-only root) are emptyDirs on the image's
cache dir and /tmp. images/smoke.sh checks the built images against the same Containerfile.
"""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

import pytest
import yaml

import kvfleet
from kvfleet.cli import build_parser
from kvfleet.operator import renderers
from kvfleet.operator.cli import config_from_args
from kvfleet.operator.spec import parse_inferenceservice
from kvfleet.operator.testing.chart import CHART, render
from kvfleet.operator.testing.crdschema import ROOT

IMAGES = json.loads((ROOT / "images" / "images.json").read_text())
CONTAINERFILE = ROOT / IMAGES["containerfile"]
GATEWAY = {"gateway": {"enabled": True}}


def _stage_config() -> Any:
    spec = importlib.util.spec_from_file_location("stage_config", ROOT / "images" / "stage_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.stage_config


stage_config = _stage_config()


def version() -> str:
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match is not None
    return match.group(1)


def built() -> dict[str, str]:
    """image reference `make images` / `make images-cuda` produce -> its Containerfile target."""
    return {f"{name}:{version()}": image["target"] for name, image in IMAGES["images"].items()}


def deployments(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in render(values) if d["kind"] == "Deployment"}


def engine_pod(gpus: int, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine pod the operator renders, configured by the flags the chart gives it."""
    operator = deployments(values or {})["kvf-operator"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser(only="operator").parse_args(["operator", *operator["args"]])
    config = config_from_args(args)
    body = {"model": {"name": "tiny", "uri": "file:///opt/kvfleet/models/tiny"}, "resources": {"gpus": gpus}}
    spec = parse_inferenceservice(body)
    owner = renderers.Owner("svc", "default", "uid")
    return renderers.render_deployment(owner, spec, config.engine_image_for(gpus))["spec"]["template"]["spec"]


def test_one_version_tags_the_package_the_chart_and_the_images() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert version() == kvfleet.__version__ == chart["appVersion"]


def test_make_images_builds_the_control_plane_and_the_cpu_engine_and_images_cuda_the_cuda_one() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^images:.*\n\t.*build\.sh kvfleet kvfleet-engine-cpu$", makefile, re.M)
    assert re.search(r"^images-cuda:.*\n\t.*build\.sh kvfleet-engine-cuda$", makefile, re.M)
    assert set(IMAGES["images"]) == {"kvfleet", "kvfleet-engine-cpu", "kvfleet-engine-cuda"}
    assert {i["target"] for i in IMAGES["images"].values()} <= set(_stages())


def _stages() -> list[str]:
    return re.findall(r"^FROM \S+ AS (\S+)$", CONTAINERFILE.read_text(), re.M)


@pytest.mark.parametrize("values", [{}, GATEWAY, {"operator": {"watchNamespaces": ["a"]}}])
def test_every_kvfleet_image_the_chart_renders_is_one_make_images_builds(values: dict[str, Any]) -> None:
    envoy = "{repository}:{tag}".format(
        **yaml.safe_load((CHART / "values.yaml").read_text())["gateway"]["image"]
    )
    refs = {
        c["image"]
        for d in deployments(values).values()
        for c in d["spec"]["template"]["spec"]["containers"]
        + d["spec"]["template"]["spec"].get("initContainers", [])
    }
    assert refs - {envoy} == {f"kvfleet:{version()}"}
    operator = deployments(values)["kvf-operator"]["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.split("=", 1) for a in operator["args"] if a.startswith("--engine-image"))
    assert flags == {
        "--engine-image-cpu": f"kvfleet-engine-cpu:{version()}",
        "--engine-image-cuda": f"kvfleet-engine-cuda:{version()}",
    }
    assert set(flags.values()) <= set(built())


def test_the_operator_renders_the_cuda_engine_for_gpus_and_the_cpu_engine_otherwise() -> None:
    assert engine_pod(0)["containers"][0]["image"] == f"kvfleet-engine-cpu:{version()}"
    assert engine_pod(1)["containers"][0]["image"] == f"kvfleet-engine-cuda:{version()}"
    mine = {"image": {"registry": "reg.example/ml"}}
    assert engine_pod(0, mine)["containers"][0]["image"] == f"reg.example/ml/kvfleet-engine-cpu:{version()}"
    assert engine_pod(2, mine)["containers"][0]["image"] == f"reg.example/ml/kvfleet-engine-cuda:{version()}"


def _pods() -> list[tuple[str, dict[str, Any]]]:
    charted = deployments(GATEWAY)
    pods = [(n, charted[n]["spec"]["template"]["spec"]) for n in ("kvf-operator", "kvf-router")]
    return [*pods, ("engine-cpu", engine_pod(0)), ("engine-cuda", engine_pod(1))]


@pytest.mark.parametrize(("name", "pod"), _pods(), ids=[n for n, _ in _pods()])
def test_each_pod_runs_its_image_as_the_containerfile_sets_it_up(name: str, pod: dict[str, Any]) -> None:
    refs = built()
    security = pod["securityContext"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in pod["containers"] + pod.get("initContainers", []):
        image = stage_config(CONTAINERFILE, refs[container["image"].rsplit("/", 1)[-1]])
        uid, gid = (int(x) for x in image["user"].split(":"))
        assert (security["runAsNonRoot"], security["runAsUser"], security["runAsGroup"]) == (True, uid, gid)
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        # the pod's command replaces the image's entrypoint: it must start the same program
        assert container["command"][0] in (image["entrypoint"][0], "python")
        assert {p["containerPort"] for p in container.get("ports", [])} <= set(image["ports"])
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        # read-only root: the image's cache dir ($KVFLEET_CACHE, $HOME) and /tmp are emptyDirs
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        writable = {image["env"]["KVFLEET_CACHE"], image["env"]["HOME"], "/tmp"}
        assert all("emptyDir" in volumes[mounts[path]] for path in writable), (name, mounts)
    if name.startswith("engine"):
        assert volumes[{m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}["/dev/shm"]][
            "emptyDir"
        ] == {"medium": "Memory"}
        assert uid == renderers.ENGINE_USER and image["env"]["KVFLEET_CACHE"] == renderers.CACHE_MOUNT


def test_the_engine_image_serves_its_baked_tiny_model_on_the_port_the_operator_probes() -> None:
    engine = stage_config(CONTAINERFILE, "engine")
    args = build_parser().parse_args(engine["cmd"])
    assert (args.model, args.port) == ("/opt/kvfleet/models/tiny", engine["ports"][0])
    assert engine_pod(0)["containers"][0]["ports"][0]["containerPort"] == engine["ports"][0]
