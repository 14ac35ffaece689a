"""``kubectl apply`` of an InferenceService → the first streamed token through the router, on the real
control plane with kvfleet installed by helm (issue #43).

Each run applies the manifest (the README's tiny example, or the same with SmolLM2's baked folder),
then at once sends one streamed chat completion through the router: the router holds it (the
InferenceService wants a replica) until the engine the real scheduler placed on the process node
is ready, so its first token marks the end of the whole path: operator → Deployment → ReplicaSet
→ Pod → engine start (torch import, weights, warm-up) → router sees it ready → first token. Then
the InferenceService is deleted and its pod waited out. Printed: median and each run per model,
with the phases from the objects' timestamps (Deployment created, pod scheduled, pod Ready).
Run: ``timeout 1800 .venv/bin/python -m bench.cluster.first_token [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import openai

from kvfleet.cluster import local

KEY = "sk-bench-first-token"


def manifest(model: str) -> dict[str, Any]:
    obj = local.load_yaml(local.REPO / "examples" / "inferenceservice-tiny-cpu.yaml")
    obj["metadata"]["name"] = obj["spec"]["model"]["name"] = model
    obj["spec"]["model"]["uri"] = f"file:///opt/kvfleet/models/{model}"
    return obj


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def phases(cluster: local.Cluster, model: str, applied: float) -> dict[str, float]:
    """Seconds after the apply (wall clock, the objects' own timestamps: 1 s resolution)."""
    deploy = json.loads(cluster.kubectl("get", "deployment", model, "-n", "default", "-o", "json"))
    pod = json.loads(
        cluster.kubectl(
            "get", "pods", "-n", "default", "-l", f"kvfleet.dev/inferenceservice={model}", "-o", "json"
        )
    )["items"][0]
    conditions = {c["type"]: stamp(c["lastTransitionTime"]) for c in pod["status"]["conditions"]}
    return {
        "deployment": stamp(deploy["metadata"]["creationTimestamp"]) - applied,
        "scheduled": conditions["PodScheduled"] - applied,
        "ready": conditions["Ready"] - applied,
    }


def one_run(cluster: local.Cluster, client: openai.OpenAI, model: str) -> tuple[float, dict[str, float]]:
    wall, start = time.time(), time.monotonic()
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest(model)))
    while True:  # the router learns of the new model from its watch a moment after the apply
        try:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=8, temperature=0, stream=True,
            )  # fmt: skip
            break
        except openai.NotFoundError:
            time.sleep(0.05)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - start
    assert first is not None, "no token"
    steps = phases(cluster, model, wall)
    cluster.kubectl("delete", "kis", model, "-n", "default", "--wait=true", "--timeout=120s")
    cluster.kubectl("wait", "--for=delete", "pod", "-l", f"kvfleet.dev/inferenceservice={model}", "-n", "default", "--timeout=120s", check=False)  # fmt: skip
    return first, steps


def main(runs: int, models: list[str]) -> None:
    cpu = next(
        ln.split(":", 1)[1].strip()
        for ln in Path("/proc/cpuinfo").read_text().splitlines()
        if ln.startswith("model name")
    )
    print(
        f"kubectl apply -> first streamed token through the router; {runs} runs a model; {os.cpu_count()} CPUs ({cpu})"
    )
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        cluster = local.up(Path(tmp) / "cluster", models=("tiny", "smollm2"))
        try:
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bench-key", "namespace": "default"}, "stringData": {"api-key": KEY}}  # fmt: skip
            quota = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "TenantQuota", "metadata": {"name": "bench", "namespace": "default"}, "spec": {"tenant": "bench", "apiKeySecretRef": {"name": "bench-key"}}}  # fmt: skip
            for obj in (secret, quota):
                cluster.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
            pods = json.loads(
                cluster.kubectl(
                    "get",
                    "pods",
                    "-n",
                    local.NAMESPACE,
                    "-l",
                    "app.kubernetes.io/name=kvfleet-router",
                    "-o",
                    "json",
                )
            )
            url = f"http://{pods['items'][0]['status']['podIP']}:8080/v1"
            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=600)
            time.sleep(3)  # the router has seen the tenant
            for model in models:
                results = [one_run(cluster, client, model) for _ in range(runs)]
                firsts = [r[0] for r in results]
                print(
                    f"{model}: first token {statistics.median(firsts):.1f} s median (runs: {', '.join(f'{v:.1f}' for v in firsts)})"
                )
                for name in ("deployment", "scheduled", "ready"):
                    values = [r[1][name] for r in results]
                    print(
                        f"  {name:10s} at {statistics.median(values):5.1f} s (runs: {', '.join(f'{v:.0f}' for v in values)})"
                    )
        finally:
            cluster.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    args = parser.parse_args()
    main(args.runs, args.models)
