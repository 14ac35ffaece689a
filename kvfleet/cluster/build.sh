#!/usr/bin/env bash
# The local control plane's binaries (issue #43), built from their Go modules and cached by version
# outside the repository: $KVFLEET_K8S_CACHE (default ~/.cache/kvfleet/k8s)/<tool>-<version>/bin.
# A fresh machine builds each once (minutes: see docs/cluster.md); later runs find the stamp and
# return at once. Prints one line per tool: NAME=PATH-TO-BIN-FOLDER.
#
#   etcd                               go.etcd.io/etcd/server/v3   (+ etcdctl)
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#                                      k8s.io/kubernetes, every k8s.io/* staging module pinned to v0.N.x
#   kwok                               sigs.k8s.io/kwok
#   helm                               helm.sh/helm/v3
set -euo pipefail
K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.7.4}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
HELM_VERSION=${HELM_VERSION:-v3.22.1}
CACHE=${KVFLEET_K8S_CACHE:-$HOME/.cache/kvfleet/k8s}
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-buildvcs=false CGO_ENABLED=0
command -v go >/dev/null || { echo "build.sh: go is not installed (Go >= 1.26 builds these binaries)" >&2; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
# one build at a time: a second caller waits, then finds the stamps (a check alone never waits)
if [ -z "${KVFLEET_K8S_NO_BUILD:-}" ]; then flock 9; fi

# build NAME VERSION MODULE PACKAGES LDFLAGS [REPLACES]: a throwaway module requiring MODULE@VERSION,
# built once into $CACHE/NAME-VERSION/bin (each binary named after its package's last element, or
# by $RENAME's FROM:TO pairs); a stamp file marks a finished build.
build() {
  local name=$1 version=$2 module=$3 packages=$4 ldflags=$5 replaces=${6:-}
  local dir="$CACHE/$name-$version"
  if [ -f "$dir/.built" ]; then echo "$name=$dir/bin"; return; fi
  if [ -n "${KVFLEET_K8S_NO_BUILD:-}" ]; then echo "build.sh: $name $version is not built" >&2; exit 3; fi
  rm -rf "$dir/src" && mkdir -p "$dir/src" "$dir/bin"
  (
    cd "$dir/src"
    printf 'module kvfleet.dev/cluster/%s\n\ngo 1.26\n\nrequire %s %s\n%s\n' "$name" "$module" "$version" "$replaces" > go.mod
    local t0=$SECONDS
    # shellcheck disable=SC2086
    go build -mod=mod -ldflags "$ldflags" -o "$dir/bin/" $packages
    local pair
    for pair in ${RENAME:-}; do mv "$dir/bin/${pair%%:*}" "$dir/bin/${pair##*:}"; done
    echo "$name $version built in $((SECONDS - t0)) s" >&2
  )
  touch "$dir/.built"
  echo "$name=$dir/bin"
}

# k8s.io/kubernetes replaces its staging modules with ./staging paths; a module outside the repo
# pins each to the matching v0.N.x tag instead (as kubernetes-sigs/scheduler-plugins does).
k8s_replaces() {
  local staging=v0.${K8S_VERSION#v1.}
  curl -fsS -m 60 "${GOPROXY_URL:-https://proxy.golang.org}/k8s.io/kubernetes/@v/$K8S_VERSION.mod" \
    | sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#replace \1 => \1 '"$staging"'#p'
}

k8s_ldflags() {
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local v
  for v in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    printf -- '-X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean -X %s.buildDate=%s ' \
      "$v" "$K8S_VERSION" "$v" "$v" "$minor" "$v" "$v" "$date"
  done
  printf -- '-s -w'
}

only=${1:-all}
want() { [ "$only" = all ] || [ "$only" = "$1" ]; }
if want etcd; then RENAME="server:etcd" build etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 \
  "go.etcd.io/etcd/server/v3 go.etcd.io/etcd/etcdctl/v3" "-s -w" \
  "require go.etcd.io/etcd/etcdctl/v3 $ETCD_VERSION"; fi
if want kubernetes; then build kubernetes "$K8S_VERSION" k8s.io/kubernetes \
  "k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl" \
  "$(k8s_ldflags)" "$(k8s_replaces)"; fi
if want kwok; then build kwok "$KWOK_VERSION" sigs.k8s.io/kwok "sigs.k8s.io/kwok/cmd/kwok" "-s -w"; fi
if want helm; then build helm "$HELM_VERSION" helm.sh/helm/v3 "helm.sh/helm/v3/cmd/helm" \
  "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"; fi
