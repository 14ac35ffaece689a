#!/usr/bin/env bash
# Creates (idempotently) the virtual environment bench/guidellm_check.py runs guidellm from; prints its
# guidellm command.   bash bench/guidellm_env.sh  # -> ${KVFLEET_GUIDELLM_VENV:-$HOME/.cache/kvfleet/guidellm-venv}/bin/guidellm
# guidellm 0.8.1 would upgrade click, multidict, websockets and more in kvfleet's .venv (pip install --dry-run),
# so it gets a venv of its own. Bounded by KVFLEET_GUIDELLM_INSTALL_TIMEOUT seconds (default 600).
set -euo pipefail
VENV="${KVFLEET_GUIDELLM_VENV:-$HOME/.cache/kvfleet/guidellm-venv}"
VERSION="${KVFLEET_GUIDELLM_VERSION:-0.8.1}"
LIMIT="${KVFLEET_GUIDELLM_INSTALL_TIMEOUT:-600}"
STAMP="$VENV/.kvfleet-guidellm-$VERSION"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -f "$STAMP" ]; then
  [ -x "$VENV/bin/python" ] || timeout 120 python3 -m venv "$VENV" >&2
  timeout "$LIMIT" "$VENV/bin/pip" install -q "guidellm==$VERSION" >&2
  (cd / && timeout 120 "$VENV/bin/guidellm" --help >/dev/null)
  touch "$STAMP"
fi
echo "$VENV/bin/guidellm"
