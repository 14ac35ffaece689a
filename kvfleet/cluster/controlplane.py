"""A real Kubernetes control plane on this machine: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler (docs/cluster.md, issue #43).

Where it sits: the bottom of ``kvfleet.cluster``. :mod:`.binaries` builds the Go binaries once;
this module starts them as child processes on free loopback ports with RBAC on, a CA of its own
(every client verifies the API server's certificate), service-account token signing, and an audit
log (``audit.log``: one JSON line per request, which the e2e tests read to prove the chart's RBAC
grants what kvfleet uses and that a re-apply writes nothing). :mod:`.local` adds the nodes and
kvfleet on top. ``python -m kvfleet.cluster.controlplane up|down --state-dir DIR`` runs it alone.

Users: ``admin`` (system:masters, the kubeconfig ``admin.kubeconfig``), and the
controller-manager and scheduler under their own bootstrap identities, so the cluster's default
RBAC applies to them as on any cluster (the controller-manager's controllers use their own
service accounts).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.oslib import free_port

from . import binaries
from .procs import Proc, stop_all, wait_until

AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  nonResourceURLs: ["/healthz*", "/livez*", "/readyz*", "/version", "/openapi*"]
- level: Metadata
"""
SERVICE_CIDR = "10.96.0.0/16"  # API data only: no traffic goes to a ClusterIP here (no kube-proxy)
ISSUER = "https://kubernetes.default.svc.cluster.local"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path) -> None:
    """A CA, the API server's serving certificate signed by it, and the service-account key pair."""
    if (folder / "apiserver.crt").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=kvfleet-local-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
             "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=folder)  # fmt: skip
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-extfile", "san.ext", "-out", "apiserver.crt", cwd=folder)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)


def kubeconfig_text(server: str, ca_file: Path, user: str, token: str) -> str:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "kvfleet-local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "kvfleet-local", "context": {"cluster": "kvfleet-local", "user": user}}],
        "current-context": "kvfleet-local",
    }
    return json.dumps(cfg, indent=2)  # JSON is YAML: every client reads it


@dataclass
class ControlPlane:
    """The running control plane: its folder, the API server's URL and the processes it started."""

    state: Path
    server: str = ""
    procs: list[Proc] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.state / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.state / "audit.log"

    @property
    def ca_file(self) -> Path:
        return self.state / "pki" / "ca.crt"

    def stop(self) -> None:
        stop_all(self.procs)
        self.procs.clear()


def _write_identities(state: Path, server: str) -> dict[str, Path]:
    """Static tokens for admin, the controller-manager and the scheduler; a kubeconfig each."""
    users = {
        "admin": ("admin", "system:masters"),
        "kube-controller-manager": ("system:kube-controller-manager", ""),
        "kube-scheduler": ("system:kube-scheduler", ""),
    }
    tokens = state / "pki" / "tokens.csv"
    rows, paths = [], {}
    for name, (user, group) in users.items():
        token = secrets.token_hex(16)
        rows.append(f"{token},{user},{user}" + (f',"{group}"' if group else ""))
        paths[name] = state / f"{name}.kubeconfig"
        paths[name].write_text(kubeconfig_text(server, state / "pki" / "ca.crt", user, token))
    tokens.write_text("\n".join(rows) + "\n")
    return paths


def _etcd(state: Path, bins: binaries.Binaries) -> tuple[Proc, str]:
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    args = [
        str(bins.etcd), "--name", "default", "--data-dir", str(state / "etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"default=http://127.0.0.1:{peer}", "--unsafe-no-fsync",
        "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}", "--log-level", "warn",
    ]  # fmt: skip
    return Proc.start("etcd", args, state / "logs"), url


def _apiserver_args(state: Path, bins: binaries.Binaries, etcd_url: str, port: int) -> list[str]:
    pki = state / "pki"
    (state / "audit-policy.yaml").write_text(AUDIT_POLICY)
    return [
        str(bins.kube_apiserver), "--etcd-servers", etcd_url,
        "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(port),
        "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
        "--client-ca-file", str(pki / "ca.crt"), "--token-auth-file", str(pki / "tokens.csv"),
        "--authorization-mode", "Node,RBAC", "--allow-privileged=true",
        "--service-account-issuer", ISSUER, "--service-account-key-file", str(pki / "sa.pub"),
        "--service-account-signing-key-file", str(pki / "sa.key"),
        "--service-cluster-ip-range", SERVICE_CIDR,
        "--audit-policy-file", str(state / "audit-policy.yaml"), "--audit-log-path", str(state / "audit.log"),
        "--audit-log-format", "json", "--audit-log-mode", "blocking",
        "--endpoint-reconciler-type", "none",  # its Endpoints may not hold a loopback address
        "--enable-priority-and-fairness=false", "--profiling=false", "--v", "1",
    ]  # fmt: skip


def _controllers(state: Path, bins: binaries.Binaries, kubeconfigs: dict[str, Path]) -> list[Proc]:
    pki = state / "pki"
    kcm = [
        str(bins.kube_controller_manager), "--kubeconfig", str(kubeconfigs["kube-controller-manager"]),
        "--use-service-account-credentials", "--controllers", "*",
        "--service-account-private-key-file", str(pki / "sa.key"), "--root-ca-file", str(pki / "ca.crt"),
        "--leader-elect=false", "--secure-port", "0", "--concurrent-gc-syncs", "5",
        "--node-monitor-grace-period", "60s", "--v", "1",
    ]  # fmt: skip
    scheduler = [
        str(bins.kube_scheduler), "--kubeconfig", str(kubeconfigs["kube-scheduler"]),
        "--leader-elect=false", "--secure-port", "0", "--v", "1",
    ]  # fmt: skip
    logs = state / "logs"
    return [Proc.start("kube-controller-manager", kcm, logs), Proc.start("kube-scheduler", scheduler, logs)]


def _api_ready(cp: ControlPlane, timeout: float) -> None:
    import ssl
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(cp.ca_file))
    token = json.loads(cp.kubeconfig.read_text())["users"][0]["user"]["token"]
    request = urllib.request.Request(f"{cp.server}/readyz", headers={"Authorization": f"Bearer {token}"})

    def ready() -> bool:
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    wait_until(ready, timeout, "kube-apiserver /readyz", cp.procs)


def start(state: Path, *, timeout: float = 120.0) -> ControlPlane:
    """Start etcd, the API server, then the controller-manager and the scheduler; ready when it returns."""
    state = state.resolve()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    bins = binaries.ensure()
    make_pki(state / "pki")
    port = free_port()
    cp = ControlPlane(state=state, server=f"https://127.0.0.1:{port}")
    kubeconfigs = _write_identities(state, cp.server)
    try:
        etcd, etcd_url = _etcd(state, bins)
        cp.procs.append(etcd)
        cp.procs.append(
            Proc.start("kube-apiserver", _apiserver_args(state, bins, etcd_url, port), state / "logs")
        )
        _api_ready(cp, timeout)
        cp.procs += _controllers(state, bins, kubeconfigs)
    except BaseException:
        cp.stop()
        raise
    (state / "controlplane.json").write_text(
        json.dumps({"server": cp.server, "pids": [p.pid for p in cp.procs]})
    )
    return cp


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """TERM a process group started by another process, KILL it after ``grace`` seconds."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


def stop_recorded(state: Path) -> None:
    """Stop what ``up`` started in another process (its pids recorded in controlplane.json)."""
    record = state / "controlplane.json"
    if not record.exists():
        return
    for pid in reversed(json.loads(record.read_text())["pids"]):
        stop_pid(pid)
    record.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet.cluster.controlplane", description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state-dir", type=Path, required=True, help="folder for etcd's data, certs, logs")
    args = parser.parse_args(argv)
    if args.action == "down":
        stop_recorded(args.state_dir)
        return 0
    cp = start(args.state_dir)
    for proc in cp.procs:
        proc.detach()
    print(f"KUBECONFIG={cp.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
