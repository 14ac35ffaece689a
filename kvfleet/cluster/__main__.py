"""``python -m kvfleet.cluster up|down|build``: the local kvfleet cluster of ``make cluster-up`` (docs/cluster.md).

``up`` builds the Kubernetes binaries once (cached by version), starts the control plane, the process
node and kwok, installs kvfleet with ``kubectl apply --server-side -f crds/`` and ``helm install``,
and prints ``KUBECONFIG=PATH`` as its last line; everything keeps running after it returns.
``down`` stops every process ``up`` started. ``build`` only builds the binaries (``make test``
starts it in the background, so a fresh machine's cold build runs beside the unit tests).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import binaries, local

DEFAULT_STATE = Path(os.environ.get("KVFLEET_CLUSTER_STATE", Path.home() / ".cache" / "kvfleet" / "cluster"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet.cluster", description=__doc__)
    parser.add_argument("action", choices=["up", "down", "build"])
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE,
        help=f"etcd's data, certificates, logs and the pods' folders (default {DEFAULT_STATE})",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(local.DEFAULT_MODELS),
        help="models baked into the process node's /opt/kvfleet/models (tiny, smollm2)",
    )
    parser.add_argument("--no-install", action="store_true", help="the cluster without kvfleet on it")
    args = parser.parse_args(argv)
    if args.action == "build":
        print(binaries.ensure())
        return 0
    if args.action == "down":
        local.down(args.state_dir)
        print(f"stopped the cluster of {args.state_dir}")
        return 0
    local.down(args.state_dir)  # a cluster left running from an earlier `up` in this folder
    cluster = local.up(args.state_dir, models=args.models, install=not args.no_install)
    for proc in [*cluster.cp.procs, *cluster.procs]:
        proc.detach()
    print(f"logs: {cluster.state / 'logs'}; stop with: make cluster-down")
    print(f"KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
