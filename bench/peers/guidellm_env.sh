#!/usr/bin/env bash
# Creates (idempotently) the virtual environment bench/peers/guidellm_check.py runs guidellm from; prints its
# guidellm command.   bash bench/peers/guidellm_env.sh  # -> ${KVFLEET_GUIDELLM_VENV:-$HOME/.cache/kvfleet/guidellm-venv}/bin/guidellm
# guidellm 0.8.1 would upgrade click, multidict, websockets and more in kvfleet's .venv (pip install --dry-run),
# so it gets a venv of its own. Bounded by KVFLEET_GUIDELLM_INSTALL_TIMEOUT seconds (default 600).
set -euo pipefail
source "$(dirname "$0")/side_venv.sh"
VENV="${KVFLEET_GUIDELLM_VENV:-$HOME/.cache/kvfleet/guidellm-venv}"
side_venv_check() { (cd / && timeout 120 "$1/bin/guidellm" --help >/dev/null); }
side_venv "$VENV" "guidellm==${KVFLEET_GUIDELLM_VERSION:-0.8.1}" "${KVFLEET_GUIDELLM_INSTALL_TIMEOUT:-600}"
echo "$VENV/bin/guidellm"
