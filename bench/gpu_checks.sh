#!/usr/bin/env bash
# Issue #2's GPU checks as one run on a lent machine: the gpu-marked kernel tests at Llama-3-8B
# shapes in bf16, then bench/gpu_decode.py (copy bandwidth, decode tok/s and MBU, 1B and 8B
# shapes at batch 1/32/128). Output: $OUT/gpu_tests.txt and $OUT/gpu_decode.txt.
#
# The device image has torch, triton, transformers, safetensors, tokenizers and pytest, but not
# pydantic, which the engine's config needs. Before the run, here, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection typing-extensions
# then: run(command="bash bench/gpu_checks.sh", carry=[".whl"], timeout_s=540).
# Without a GPU it checks itself: SMOKE=1 PYTHON=.venv/bin/python bash bench/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site/wheels" .whl/*.whl || exit 1
fi
# kvfleet.<part> lives in the top-level folders (docs/architecture.md §2): a tree of links lays them out as Python imports them.
mkdir -p "$site/tree/kvfleet"
for f in "$PWD"/kvfleet/*; do ln -s "$f" "$site/tree/kvfleet/"; done
for p in engine router operator; do ln -s "$PWD/$p" "$site/tree/kvfleet/$p"; done
export PYTHONPATH="$site/tree:$site/wheels${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee "$OUT/gpu_tests.txt"
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/engine/kernels 2>&1 | tee -a "$OUT/gpu_tests.txt"
tests=${PIPESTATUS[0]}
smoke=()
if [ "${SMOKE:-0}" = 1 ]; then smoke=(--smoke); export TRITON_INTERPRET=1; fi
"$PYTHON" bench/gpu_decode.py --out "$OUT" "${smoke[@]}" 2>&1 | tail -40
bench=${PIPESTATUS[0]}
echo "gpu tests rc=$tests, gpu_decode rc=$bench; output in $OUT"
exit $((tests || bench))
