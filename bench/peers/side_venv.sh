#!/usr/bin/env bash
# Sourced by bench/peers/vllm_env.sh and bench/peers/guidellm_env.sh: a peer tool gets a virtual environment of its own
# (its pins would move kvfleet's .venv), created once and stamped by requirement so a new version reinstalls.
#   side_venv VENV REQUIREMENT LIMIT_S   # calls side_venv_check VENV (the caller defines it) before stamping;
#   a caller that defines side_venv_install VENV REQUIREMENT LIMIT_S installs its own way (else pip install)
side_venv() {
  local venv=$1 requirement=$2 limit=$3
  local stamp="$venv/.kvfleet-${requirement/==/-}"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  [ -f "$stamp" ] && return 0
  [ -x "$venv/bin/python" ] || timeout 120 python3 -m venv "$venv" >&2
  if declare -F side_venv_install >/dev/null; then
    side_venv_install "$venv" "$requirement" "$limit"
  else
    timeout "$limit" "$venv/bin/pip" install -q "$requirement" >&2
  fi
  side_venv_check "$venv"
  touch "$stamp"
}
