# The two commands of the README: `make run` (a local fleet on the embedded model) and `make test`.
# Both set up what they need themselves: a .venv, torch first (CPU build where one is on disk), then the rest.

PYTHON ?= python3
MODEL  ?= smollm2
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint import-tree typecheck contracts pytest system-deps venv clean cluster-up cluster-down cluster-prebuild

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the tests drive for real: redis-server (router state), prometheus (promtool for the rules),
# gcc (the engine's native CPU decode kernel is compiled on first use; the process node's bind shim),
# openssl (the local cluster's CA and certificates).
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v promtool >/dev/null || ! command -v cc >/dev/null || ! command -v openssl >/dev/null; then \
	  if command -v apt-get >/dev/null; then \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server prometheus gcc libc6-dev openssl >/dev/null; \
	  else echo "install redis-server, promtool (prometheus) and gcc yourself"; fi; \
	fi

run: $(STAMP)
	$(BIN)/kvfleet up --model $(MODEL) --port 8080

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# kvfleet/{engine,router,operator} are committed symlinks to the parts, so kvfleet/ is laid out as
# Python imports it (docs/architecture.md §2): import-linter reads it from the root. mypy reads it from a
# folder of its own: from the root it would take the root's operator/ for the standard library's operator.
import-tree:
	@rm -rf build/imports && mkdir -p build/imports && ln -s ../../kvfleet build/imports/kvfleet

typecheck: $(STAMP) import-tree
	cd build/imports && ../../$(BIN)/mypy --cache-dir ../../.mypy_cache --config-file ../../pyproject.toml -p kvfleet

contracts: $(STAMP)
	$(BIN)/lint-imports

pytest: $(STAMP) system-deps
	$(BIN)/pytest -q -p no:cacheprovider

test: cluster-prebuild lint typecheck contracts pytest

# e2e/cluster needs the Go binaries: on a fresh machine their cold build (~19 minutes on 2 cores,
# docs/cluster.md) starts here in the background, niced, and runs beside lint and the unit tests;
# e2e/cluster (collected last) waits for it. Nothing happens where they are built or Go is missing.
cluster-prebuild: $(STAMP)
	@if command -v go >/dev/null && ! KVFLEET_K8S_NO_BUILD=1 bash kvfleet/cluster/build.sh >/dev/null 2>&1; then \
	  mkdir -p build && echo "building the cluster binaries in the background (log: build/cluster-build.log)"; \
	  nohup nice -n 19 $(BIN)/python -m kvfleet.cluster build > build/cluster-build.log 2>&1 & \
	fi

# A local Kubernetes cluster with kvfleet installed (docs/cluster.md): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok and helm built once from their Go modules
# (cached by version in ~/.cache/kvfleet/k8s), a process node whose pods are local processes,
# `kubectl apply --server-side -f crds/` and `helm install`. The last line printed is KUBECONFIG=PATH.
cluster-up: $(STAMP) system-deps
	$(BIN)/python -m kvfleet.cluster up

cluster-down: $(STAMP)
	$(BIN)/python -m kvfleet.cluster down

clean:
	rm -rf $(VENV) build *.egg-info

# Container images (images/, docs/images.md): build/images/kvfleet.oci.tar and
# build/images/kvfleet-engine-cpu.oci.tar, tagged with the package version. A plain `make images`
# is CI's build: buildah from a Debian rootfs made here with debootstrap (BASE=local), as no
# registry is reachable; naming the tool (IMAGE_TOOL=docker|podman|buildah) builds from the public
# base (python:3.11-slim-bookworm, a CUDA runtime for -cuda) unless BASE says otherwise.
ifeq ($(origin IMAGE_TOOL),undefined)
BASE ?= local
endif
IMAGE_TOOL ?= buildah
MODELS ?= tiny
IMAGES_ENV = IMAGE_TOOL='$(IMAGE_TOOL)' BASE='$(BASE)' MODELS='$(MODELS)'
.PHONY: images images-cuda images-smoke image-deps

images: image-deps
	$(IMAGES_ENV) bash images/build.sh kvfleet kvfleet-engine-cpu

# The -cuda engine: CUDA torch wheels on a CUDA runtime base (images.json; BASE=... to choose,
# BASE=local for the Debian rootfs: the wheels carry CUDA's libraries); several GB, so not in CI.
images-cuda: image-deps
	$(IMAGES_ENV) BASE='$(if $(filter command line environment,$(origin BASE)),$(BASE))' bash images/build.sh kvfleet-engine-cuda

# Debian packages the buildah path needs (buildah; debootstrap for BASE=local; skopeo to copy archives).
image-deps:
	@if [ "$(IMAGE_TOOL)" = buildah ] && ! { command -v buildah && command -v debootstrap && command -v skopeo; } >/dev/null; then \
	  if command -v apt-get >/dev/null; then \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah debootstrap skopeo >/dev/null; \
	  else echo "install buildah, debootstrap and skopeo yourself"; fi; \
	fi

# Runs the built images as the chart runs them, inside buildah (CI, after `make images`).
images-smoke:
	bash images/smoke.sh
