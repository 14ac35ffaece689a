#!/usr/bin/env bash
# Sourced by bench/peers/vllm_env.sh and bench/peers/guidellm_env.sh: a peer tool gets a virtual environment of its own
# (its pins would move kvfleet's .venv), created once and stamped by requirement so a new version reinstalls.
#   side_venv VENV REQUIREMENT LIMIT_S   # calls side_venv_check VENV (the caller defines it) before stamping
side_venv() {
  local venv=$1 requirement=$2 limit=$3
  local stamp="$venv/.kvfleet-${requirement/==/-}"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  [ -f "$stamp" ] && return 0
  [ -x "$venv/bin/python" ] || timeout 120 python3 -m venv "$venv" >&2
  timeout "$limit" "$venv/bin/pip" install -q "$requirement" >&2
  side_venv_check "$venv"
  touch "$stamp"
}
