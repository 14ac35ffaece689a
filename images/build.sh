#!/usr/bin/env bash
# Build kvfleet's images from images/Containerfile and write each as an OCI archive:
#
#   images/build.sh kvfleet kvfleet-engine-cpu      (`make images`; `make images-cuda` for the -cuda one)
#
# Environment (the Makefile sets it):
#   IMAGE_TOOL    buildah (default), podman or docker
#   BASE          an image to start from, or `local`: a Debian bookworm rootfs made here with
#                 debootstrap and imported with buildah, for a machine that reaches no registry
#                 (a plain `make images`). Default: the image's base in images.json (the CUDA
#                 runtime for -cuda), else its default_base (python:3.11-slim-bookworm).
#   MODELS        models baked into the engine images (tiny, smollm2); default tiny
#   OUT           where the archives go (build/images)
#   IMAGES_CACHE  buildah's storage and the debootstrap rootfs (/var/cache/kvfleet-images), kept
#                 between runs so a rebuild only redoes the layers whose inputs changed
#   BUILDAH       the buildah command line (default: images/buildah.sh: overlay or vfs storage under
#                 IMAGES_CACHE; STORAGE_DRIVER=vfs forces vfs)
#   HOST_CA, WHEELS  a CA bundle and a wheel folder mounted into the build (never into the image);
#                 default: pip's own settings on this machine (`pip config get global.cert|find-links`)
#   DEBIAN_MIRROR for BASE=local; default: the mirror apt uses here
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_TOOL=${IMAGE_TOOL:-buildah}
MODELS=${MODELS:-tiny}
OUT=${OUT:-build/images}
source images/buildah.sh
[ $# -gt 0 ] || set -- kvfleet kvfleet-engine-cpu

VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$REVISION" != unknown ] && [ -n "$(git status --porcelain -- . 2>/dev/null)" ]; then REVISION="$REVISION-dirty"; fi
json() { python3 -c "import json,sys; d=json.load(open('images/images.json')); $1" "${@:2}"; }

log() { printf '\n== %s\n' "$*" >&2; }

case "$IMAGE_TOOL" in
  buildah) read -r -a TOOL <<<"$BUILDAH"; BUILD=(bud --isolation chroot --layers) ;;
  podman) TOOL=(podman); BUILD=(build --layers) ;;
  docker) TOOL=(docker); BUILD=(build) ;;
  *) echo "IMAGE_TOOL is buildah, podman or docker" >&2; exit 2 ;;
esac

# pip on this machine may sit behind a TLS proxy (its CA) and keep wheels on disk (find-links):
# the build mounts both and passes their paths; docker's build has no mounts, it goes without.
if [ "$IMAGE_TOOL" != docker ]; then
  PIP=$(command -v pip3 || command -v pip || true)
  pip_setting() {  # the last value `pip config list` shows for this key, in any scope
    [ -n "$PIP" ] || return 0
    "$PIP" config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" | tail -1
  }
  HOST_CA=${HOST_CA-${PIP_CERT:-$(pip_setting cert)}}
  WHEELS=${WHEELS-$(pip_setting find-links)}
else
  HOST_CA=${HOST_CA:-}; WHEELS=${WHEELS:-}
fi
MOUNTS=()
if [ -n "$HOST_CA" ] && [ -f "$HOST_CA" ]; then MOUNTS+=(--volume "$HOST_CA:/host-ca.crt:ro" --build-arg HOST_CA=/host-ca.crt); fi
WHEELS_MOUNT=()
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then WHEELS_MOUNT=(--volume "$WHEELS:/wheels:ro" --build-arg WHEELS=/wheels); fi
# The CPU torch comes from download.pytorch.org/whl/cpu unless TORCH_INDEX_URL says otherwise, or the
# mounted wheel folder has it already (then no index is asked: it may not be reachable).
TORCH_ARGS=()
if [ -n "${TORCH_INDEX_URL+set}" ]; then
  TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif [ -n "$WHEELS" ] && compgen -G "$WHEELS/torch-*+cpu-*.whl" >/dev/null; then
  TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=")
elif ! curl -fsS -m 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
  # No CPU wheel reachable: PyPI's torch is the CUDA build, and its NVIDIA libraries come along (the
  # CPU image's cost, docs/images.md). Not asking the unreachable index saves pip's retries per package.
  echo "images: download.pytorch.org is not reachable: the CPU engine takes PyPI's torch (the CUDA build)" >&2
  TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=")
fi

debian_mirror() {
  local uri
  uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
        | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ')
  echo "${uri:-http://deb.debian.org/debian}"
}

# BASE=local: a minimal Debian bookworm with Python 3.11 and venv (what python:3.11-slim-bookworm
# gives), made with debootstrap, slimmed (apt lists and .debs, docs, man pages, locales) and
# imported as localhost/kvfleet-base:bookworm. The rootfs is cached under IMAGES_CACHE.
local_base() {
  local ref rootfs c m
  ref=$(json 'print(d["local_base"])')
  [ "$IMAGE_TOOL" = buildah ] || { echo "BASE=local needs IMAGE_TOOL=buildah" >&2; exit 2; }
  if "${TOOL[@]}" inspect --type image "$ref" >/dev/null 2>&1; then echo "$ref"; return; fi
  rootfs=$IMAGES_CACHE/rootfs-bookworm
  if [ ! -f "$rootfs/.complete" ]; then
    log "debootstrap bookworm from $(debian_mirror) into $rootfs" 
    rm -rf "$rootfs" "$rootfs.tmp"
    timeout 900 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$rootfs.tmp" "${DEBIAN_MIRROR:-$(debian_mirror)}" >&2
    rm -rf "$rootfs.tmp"/var/cache/apt/archives/*.deb "$rootfs.tmp"/var/lib/apt/lists/* \
      "$rootfs.tmp"/usr/share/doc/* "$rootfs.tmp"/usr/share/man/* "$rootfs.tmp"/usr/share/locale/*
    mv "$rootfs.tmp" "$rootfs"
    touch "$rootfs/.complete"
  fi
  log "importing $rootfs as $ref"
  c=$("${TOOL[@]}" from scratch)
  m=$("${TOOL[@]}" mount "$c")
  (cd "$rootfs" && tar --exclude=./.complete -cf - .) | tar -C "$m" -xf -
  "${TOOL[@]}" umount "$c" >/dev/null
  "${TOOL[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$c"
  "${TOOL[@]}" commit --rm "$c" "$ref" >&2
  echo "$ref"
}

# The layers of an OCI archive with their sizes (compressed) and the step that made each.
print_layers() {
  python3 - "$1" <<'EOF'
import json, sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    blob = lambda digest: json.load(tar.extractfile("blobs/" + digest.replace(":", "/")))
    manifest = blob(json.load(tar.extractfile("index.json"))["manifests"][0]["digest"])
    config = blob(manifest["config"]["digest"])
steps = [h for h in config.get("history", []) if not h.get("empty_layer")]
for layer, step in zip(manifest["layers"], steps):
    made = " ".join(step.get("created_by", "").split())
    print(f"    {layer['size'] / 2**20:8.1f} MiB  {made[:110]}")
EOF
}

mkdir -p "$OUT"
if [ "${BASE:-}" = local ]; then BASE=$(local_base); fi
SIZES=()
for name in "$@"; do
  target=$(json 'print(d["images"][sys.argv[1]]["target"])' "$name")
  base=${BASE:-$(json 'i=d["images"][sys.argv[1]]; print(i.get("base", d["default_base"]))' "$name")}
  mapfile -t args < <(json 'print("\n".join(f"--build-arg={k}={v}" for k, v in d["images"][sys.argv[1]]["build_args"].items()))' "$name" | grep .)
  # the local wheel folder may hold a CPU torch (2.13.0+cpu sorts above PyPI's CUDA 2.13.0): not for -cuda
  WHEEL_MOUNT=()
  [[ $name == *-cuda ]] || WHEEL_MOUNT=(${WHEELS_MOUNT[@]+"${WHEELS_MOUNT[@]}"})
  ref=localhost/$name:$VERSION
  [ "$IMAGE_TOOL" = docker ] && ref=$name:$VERSION
  log "building $ref (--target $target, BASE=$base) with $IMAGE_TOOL"
  start=$SECONDS
  "${TOOL[@]}" "${BUILD[@]}" -f images/Containerfile --target "$target" \
    --build-arg "BASE=$base" --build-arg "MODELS=$MODELS" --build-arg "VERSION=$VERSION" \
    --build-arg "REVISION=$REVISION" ${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"} ${args[@]+"${args[@]}"} \
    ${MOUNTS[@]+"${MOUNTS[@]}"} ${WHEEL_MOUNT[@]+"${WHEEL_MOUNT[@]}"} -t "$ref" .
  archive=$OUT/$name.oci.tar
  rm -f "$archive"
  case "$IMAGE_TOOL" in
    buildah) "${TOOL[@]}" push "$ref" "oci-archive:$archive:$name:$VERSION" ;;
    podman) podman save --format oci-archive -o "$archive" "$ref" ;;
    docker)
      docker save -o "$OUT/$name.docker.tar" "$ref"
      skopeo copy "docker-archive:$OUT/$name.docker.tar" "oci-archive:$archive:$name:$VERSION"
      rm -f "$OUT/$name.docker.tar" ;;
  esac
  log "$ref: built in $((SECONDS - start)) s; layers of $archive (compressed):"
  print_layers "$archive"
  SIZES+=("$(printf '%-28s %8s MiB archive (compressed)' "$name:$VERSION" "$(( $(stat -c %s "$archive") / 1048576 ))")")
done
log "sizes"
printf '  %s\n' "${SIZES[@]}"
if [ "$IMAGE_TOOL" = buildah ]; then
  for name in "$@"; do "${TOOL[@]}" images --format '  {{.Name}}:{{.Tag}} {{.Size}} (unpacked)' "localhost/$name:$VERSION"; done
fi
