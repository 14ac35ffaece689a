#!/usr/bin/env bash
# Run the images `make images` built as the chart and the operator run them, inside buildah (chroot
# isolation shares the host network), as the image's numeric user, each command started directly
# (no shell), every wait bounded:
#
#   kvfleet-engine-cpu  `kvfleet engine` on the baked tiny model with --attention cpu: /ready, then a
#                       completion; the native decode kernel compiled by the image's gcc into the cache dir
#   kvfleet             `python3 -c 'import torch'` fails; `kvfleet operator --help` exits 0;
#                       `kvfleet router` with a tenants file: /health, then a completion through it
#                       to the engine above
#   both                the image's user, entrypoint, ports and OCI labels are the Containerfile's;
#                       the image's cache dir is empty; a run writes only under the cache dir and /tmp
set -euo pipefail
cd "$(dirname "$0")/.."

source images/buildah.sh
read -r -a B <<<"$BUILDAH"
VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)
CACHE_DIR=/var/cache/kvfleet
WORK=$(mktemp -d /tmp/kvfleet-smoke.XXXXXX)
chmod 755 "$WORK"
CONTAINERS=()
PIDS=()

cleanup() {
  local p c
  for p in ${PIDS[@]+"${PIDS[@]}"}; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 1
  for p in ${PIDS[@]+"${PIDS[@]}"}; do kill -KILL -- "-$p" 2>/dev/null || true; done
  for c in ${CONTAINERS[@]+"${CONTAINERS[@]}"}; do "${B[@]}" rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n== %s\n' "$*"; }
fail() {
  echo "SMOKE FAILED: $*" >&2
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -40 "$f" >&2; }; done
  exit 1
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_http URL SECONDS PID: until URL answers 2xx, the process dies, or the time is up.
wait_http() {
  local deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ]; do
    if curl -fsS --max-time 2 -o /dev/null "$1" 2>/dev/null; then return 0; fi
    kill -0 "$3" 2>/dev/null || fail "the process behind $1 exited"
    sleep 1
  done
  fail "$1 did not answer within $2 s"
}

# new_container IMAGE: a working container of the image, with a marker for the write check
# (called in $(...): the caller adds it to CONTAINERS for the cleanup).
new_container() {
  local c m
  c=$("${B[@]}" from --pull-never "$1")
  m=$("${B[@]}" mount "$c")
  [ -z "$(ls -A "$m$CACHE_DIR")" ] || fail "$1: $CACHE_DIR is not empty in the image: $(ls -A "$m$CACHE_DIR")"
  touch "$WORK/marker-$c"
  echo "$c"
}

# run_in CONTAINER ARGS...: a command in it as the image's user (the pod's runAsUser), in the foreground.
run_in() {
  local c=$1
  shift
  timeout 120 "${B[@]}" run --isolation chroot --user 65532:65532 ${VOLUMES[@]+"${VOLUMES[@]}"} "$c" -- "$@"
}

# start_in NAME CONTAINER ARGS...: the same in the background, in its own process group; sets PID.
start_in() {
  local name=$1 c=$2
  shift 2
  setsid timeout 900 "${B[@]}" run --isolation chroot --user 65532:65532 ${VOLUMES[@]+"${VOLUMES[@]}"} \
    "$c" -- "$@" >"$WORK/$name.log" 2>&1 &
  PID=$!
  PIDS+=("$PID")
}

stop() {
  kill -TERM -- "-$1" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null || true
}

# written_outside CONTAINER: files the runs created or changed outside the cache dir and /tmp.
written_outside() {
  local c=$1 m
  m=$("${B[@]}" mount "$c")
  # (/etc/kvfleet: the mount point buildah makes for the tenants file, a ConfigMap volume in the pod)
  (cd "$m" && find . -xdev \( -path ./proc -o -path ./sys -o -path ./dev -o -path ".$CACHE_DIR" -o -path ./tmp -o -path ./etc/kvfleet \) -prune \
     -o \( -newer "$WORK/marker-$c" -o -user 65532 \) -print) | grep -vxE '\./etc|\./etc/(hosts|resolv\.conf|hostname)|\./run(/.*)?|\.' || true
}

# check_config IMAGE TARGET: user, entrypoint, ports, labels of the built image = the Containerfile's.
check_config() {
  "${B[@]}" inspect --type image "$1" >"$WORK/inspect.json"
  python3 - "$WORK/inspect.json" "$2" "$VERSION" "$(git rev-parse HEAD)" <<'EOF' || fail "$1: its config is not the Containerfile's"
import json, sys
from pathlib import Path
sys.path.insert(0, "images")
from stage_config import stage_config
image = json.load(open(sys.argv[1]))["OCIv1"]["config"]
want = stage_config(Path("images/Containerfile"), sys.argv[2])
got = {
    "user": image.get("User"),
    "entrypoint": image.get("Entrypoint"),
    "ports": sorted(int(p.split("/")[0]) for p in image.get("ExposedPorts", {})),
}
expected = {"user": want["user"], "entrypoint": want["entrypoint"], "ports": sorted(want["ports"])}
labels = image.get("Labels", {})
print(f"   config: {got}")
print(f"   labels: { {k.rsplit('.', 1)[1]: v for k, v in labels.items() if k.startswith('org.opencontainers')} }")
assert got == expected, (got, expected)
assert labels["org.opencontainers.image.version"] == sys.argv[3], labels
assert labels["org.opencontainers.image.revision"].split("-")[0] == sys.argv[4], (labels, sys.argv[4])
assert labels["org.opencontainers.image.source"].startswith("https://"), labels
EOF
}

ENGINE=localhost/kvfleet-engine-cpu:$VERSION
CONTROL=localhost/kvfleet:$VERSION
start=$SECONDS

say "the OCI archives: readable by skopeo, convertible to the docker archive kind loads"
for name in kvfleet kvfleet-engine-cpu; do
  skopeo inspect "oci-archive:build/images/$name.oci.tar" >"$WORK/$name.json" || fail "skopeo inspect $name.oci.tar"
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["Labels"]["org.opencontainers.image.version"] == sys.argv[2], d["Labels"]; print("   " + sys.argv[3] + ": " + str(len(d["Layers"])) + " layers")' \
    "$WORK/$name.json" "$VERSION" "$name.oci.tar" || fail "$name.oci.tar labels"
done
skopeo copy -q oci-archive:build/images/kvfleet.oci.tar "docker-archive:$WORK/kvfleet.docker.tar:kvfleet:$VERSION" \
  || fail "skopeo copy to a docker archive"
tar -xOf "$WORK/kvfleet.docker.tar" manifest.json | grep -q "\"docker.io/library/kvfleet:$VERSION\"\|\"kvfleet:$VERSION\"" \
  || fail "the docker archive does not name kvfleet:$VERSION"
echo "   docker-archive: kvfleet:$VERSION"
rm -f "$WORK/kvfleet.docker.tar"

say "$ENGINE: config"
check_config "$ENGINE" engine
say "$ENGINE: kvfleet engine on the baked tiny model, --attention cpu (the kernel built by the image's gcc)"
VOLUMES=()
engine=$(new_container "$ENGINE")
CONTAINERS+=("$engine")
EPORT=$(free_port)
start_in engine "$engine" kvfleet engine --model /opt/kvfleet/models/tiny --served-model-name tiny \
  --host 127.0.0.1 --port "$EPORT" --attention cpu
ENGINE_PID=$PID
wait_http "http://127.0.0.1:$EPORT/ready" 300 "$ENGINE_PID"
echo "   /ready: $(curl -fsS --max-time 5 "http://127.0.0.1:$EPORT/ready")"
out=$(curl -fsS --max-time 60 "http://127.0.0.1:$EPORT/v1/completions" -H 'content-type: application/json' \
  -d '{"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}') || fail "engine completion"
echo "   completion: $out"
python3 -c 'import json, sys; d = json.loads(sys.argv[1]); assert d["choices"][0]["finish_reason"] and d["usage"]["completion_tokens"] == 4, d' "$out" \
  || fail "engine completion answer"
m=$("${B[@]}" mount "$engine")
ls "$m$CACHE_DIR"/kernels/paged_decode-*.so >/dev/null 2>&1 || fail "no native kernel in $CACHE_DIR/kernels"
echo "   kernel: $(cd "$m$CACHE_DIR" && ls kernels/paged_decode-*.so | head -1)"

say "$CONTROL: config"
check_config "$CONTROL" kvfleet
VOLUMES=()
control=$(new_container "$CONTROL")
CONTAINERS+=("$control")
say "$CONTROL: runs as the image's user when none is given"
uid=$(timeout 120 "${B[@]}" run --isolation chroot "$control" -- python3 -c 'import os; print(os.getuid(), os.getgid())') \
  || fail "python3 as the image's user"
[ "$uid" = "65532 65532" ] || fail "the image runs as $uid, not 65532 65532"
echo "   uid gid: $uid"
say "$CONTROL: no torch"
if run_in "$control" python3 -c 'import torch' >"$WORK/torch.log" 2>&1; then fail "torch imports in $CONTROL"; fi
grep -q "No module named 'torch'" "$WORK/torch.log" || fail "import torch failed otherwise: $(cat "$WORK/torch.log")"
echo "   import torch: $(grep -m1 ModuleNotFoundError "$WORK/torch.log")"
say "$CONTROL: kvfleet operator --help"
run_in "$control" kvfleet operator --help >"$WORK/operator.log" 2>&1 || fail "kvfleet operator --help"
grep -q -- "--engine-image-cpu" "$WORK/operator.log" || fail "operator --help"
echo "   exit 0, $(wc -l <"$WORK/operator.log") lines"
say "$CONTROL: kvfleet router with a tenants file, in front of the engine"
mkdir -p "$WORK/config"
cat >"$WORK/config/tenants.yaml" <<'EOF'
tenants:
  - tenant: smoke
    apiKey: sk-kvfleet-smoke
    models: [tiny]
EOF
chmod -R a+rX "$WORK/config"
VOLUMES=(--volume "$WORK/config:/etc/kvfleet:ro")
RPORT=$(free_port)
start_in router "$control" kvfleet router --tenants /etc/kvfleet/tenants.yaml \
  --engines "http://127.0.0.1:$EPORT" --host 127.0.0.1 --port "$RPORT"
ROUTER_PID=$PID
wait_http "http://127.0.0.1:$RPORT/health" 120 "$ROUTER_PID"
echo "   /health: $(curl -fsS --max-time 5 "http://127.0.0.1:$RPORT/health")"
out=""
for _ in $(seq 1 30); do  # the router lists the engine after its first /load poll
  out=$(curl -fsS --max-time 60 "http://127.0.0.1:$RPORT/v1/completions" -H 'content-type: application/json' \
    -H 'authorization: Bearer sk-kvfleet-smoke' -d '{"model": "tiny", "prompt": "hi", "max_tokens": 3}' 2>/dev/null) && break
  out=""
  sleep 1
done
[ -n "$out" ] || fail "no completion through the router"
echo "   completion through the router: $out"

stop "$ROUTER_PID"
stop "$ENGINE_PID"
say "writes outside $CACHE_DIR and /tmp"
for c in "$engine" "$control"; do
  w=$(written_outside "$c")
  [ -z "$w" ] || fail "$c wrote outside $CACHE_DIR and /tmp: $w"
done
echo "   none"
say "smoke passed in $((SECONDS - start)) s"
