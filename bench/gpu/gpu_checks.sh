#!/usr/bin/env bash
# The GPU checks as runs on a lent machine, by stage (default: kernels):
#   kernels  issue #2: the gpu-marked kernel tests at Llama-3-8B shapes in bf16, then
#            bench/gpu/gpu_decode.py (copy bandwidth, decode tok/s and MBU, 1B and 8B shapes at
#            batch 1/32/128). Output: $OUT/gpu_tests.txt and $OUT/gpu_decode.txt.
#   smollm2  issue #11: bench/gpu/gpu_smollm2.py (SmolLM2 on the GPU against transformers, then
#            offline speed). Output: $OUT/gpu_smollm2.txt.
#   fused    the Triton fused-op tests (tests/engine/kernels/test_triton_fused.py), compiled.
#   graphs   issue #30: the gpu-marked decode-path test (CUDA graphs vs enforce_eager, float32 greedy
#            tokens), bench/gpu/gpu_graphs.py (Llama-3-8B bf16 decode step eager / static buffers /
#            CUDA graph at batch 1/8/32/128 with MBU; SmolLM2 offline GPU-busy fraction, graphs and
#            eager, against transformers' best static batch), then the smollm2 stage's float32
#            triton check against transformers, with graphs on (the default). Needs the whole GGUF:
#            run it on the warm machine after the kernels (.gpumodel/a) call, carrying .gpumodel/b.
#            Output: $OUT/gpu_graphs.txt, $OUT/gpu_tests_graphs.txt, $OUT/gpu_smollm2.txt.
#   profile  bench/gpu/gpu_step_profile.py: where a step's time goes, SmolLM2's shapes with random
#            weights (one call: carry .gpumodel/shapes, made here by its `prepare`).
#
# The device image has torch, triton, transformers, safetensors, tokenizers and pytest, but not
# pydantic (the engine's config) nor gguf (SmolLM2's checkpoint), and it reaches no network.
# Before the runs, here, in the repository root:
#   echo /.whl/ >> .git/info/exclude; echo /.gpumodel/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf xgrammar apache-tvm-ffi
#   (versions as in .venv: two versions of one wheel stop the install; xgrammar's wheel is manylinux_2_28,
#   apache-tvm-ffi's manylinux_2_24/2_28: add those --platform tags)
# The 98 MB GGUF is over one call's 64 MiB, so it travels in two halves, one per call, on the
# same warm machine (each run keeps what it was given under /tmp/kvfleet-gguf-parts):
#   mkdir -p .gpumodel/a .gpumodel/b
#   split -b 50000000 -d ~/.cache/kvfleet/downloads/SmolLM2-135M-Instruct.Q4_1.gguf part-
#   mv part-00 .gpumodel/a/; mv part-01 .gpumodel/b/
#   run(command="bash bench/gpu/gpu_checks.sh kernels", carry=[".whl", ".gpumodel/a"], timeout_s=420)
#   run(command="bash bench/gpu/gpu_checks.sh smollm2", carry=[".whl", ".gpumodel/b"], timeout_s=420)
#   (or, for issue #30, "bash bench/gpu/gpu_checks.sh graphs" in place of the smollm2 call, timeout_s=540)
# Without a GPU it checks itself: SMOKE=1 PYTHON=.venv/bin/python bash bench/gpu/gpu_checks.sh all
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=${1:-kernels}
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
for p in engine router operator; do ln -sfn "$PWD/$p" "$site/tree/kvfleet/$p"; done  # -n: replace the kvfleet/ link, never nest into it
export PYTHONPATH="$site/tree:$site/wheels${PYTHONPATH:+:$PYTHONPATH}"
smoke=()
if [ "${SMOKE:-0}" = 1 ]; then smoke=(--smoke); fi
parts=/tmp/kvfleet-gguf-parts
mkdir -p "$parts"
for f in .gpumodel/*/part-*; do [ -f "$f" ] && cp "$f" "$parts/"; done
rc=0

kernels() {
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee "$OUT/gpu_tests.txt"
  "$PYTHON" -P -m pytest -q -p no:cacheprovider -m gpu tests/engine/kernels 2>&1 | tee -a "$OUT/gpu_tests.txt"
  local tests=${PIPESTATUS[0]}
  if [ "${SMOKE:-0}" = 1 ]; then export TRITON_INTERPRET=1; fi
  "$PYTHON" -m bench.gpu.gpu_decode --out "$OUT" "${smoke[@]}" 2>&1 | tail -40
  local bench=${PIPESTATUS[0]}
  unset TRITON_INTERPRET
  echo "gpu tests rc=$tests, gpu_decode rc=$bench"
  return $((tests || bench))
}

fused() {
  "$PYTHON" -P -m pytest -q -p no:cacheprovider tests/engine/kernels/test_triton_fused.py 2>&1 | tee "$OUT/gpu_tests_fused.txt"
  return "${PIPESTATUS[0]}"
}

smollm2() {
  export KVFLEET_CACHE=${KVFLEET_CACHE:-/tmp/kvfleet-cache}
  local gguf=$KVFLEET_CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$gguf" ] && compgen -G "$parts/part-*" >/dev/null; then
    mkdir -p "$(dirname "$gguf")"
    cat "$parts"/part-* >"$gguf.tmp" && mv "$gguf.tmp" "$gguf"
  fi
  ls -la "$parts" "$gguf" 2>&1
  "$PYTHON" -m bench.gpu.gpu_smollm2 --out "$OUT" "${smoke[@]}" "$@" 2>&1 | grep -v "it/s\]"
  local bench=${PIPESTATUS[0]}
  echo "gpu_smollm2 rc=$bench"
  return "$bench"
}

graphs() {
  "$PYTHON" -P -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_decode_path.py 2>&1 | tee "$OUT/gpu_tests_graphs.txt"
  local tests=${PIPESTATUS[0]}
  if [ "${SMOKE:-0}" = 1 ]; then export TRITON_INTERPRET=1; fi
  "$PYTHON" -m bench.gpu.gpu_graphs --out "$OUT" "${smoke[@]}" 2>&1 | grep -v "it/s\]"
  local bench=${PIPESTATUS[0]}
  unset TRITON_INTERPRET
  local equal=0
  if [ "${SMOKE:-0}" != 1 ]; then smollm2 --backends triton --dtypes float32 --hf-batches 128 || equal=1; fi
  echo "graphs: gpu tests rc=$tests, gpu_graphs rc=$bench, smollm2 float32 rc=$equal"
  return $((tests || bench || equal))
}

# issue #30 and #34's fp8 in two calls on one warm machine (the GGUF travels in halves, one per call):
#   gpu1 (carry .whl, .gpumodel/a): every gpu-marked test (kernels, fp8, CUDA graphs), the fused-op
#        tests, gpu_graphs.py's decode steps and gpu_fp8.py. Output: gpu_tests_all.txt, gpu_graphs.txt, gpu_fp8.txt.
#   gpu2 (carry .whl, .gpumodel/b): gpu_graphs.py's SmolLM2 part and the float32 greedy check against
#        transformers with graphs on. Output: gpu_graphs_smollm2.txt, gpu_smollm2.txt.
# the gpu-marked test files whose imports the device image has (tests/engine/server needs uvicorn, others openai)
gpu_tests=(tests/engine/kernels/test_fp8_gpu.py tests/engine/kernels/test_gpu_kernels.py tests/engine/kernels/test_triton_lora.py tests/engine/test_decode_path.py)

gpu1() {
  "$PYTHON" -P -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}" 2>&1 | tee "$OUT/gpu_tests_all.txt"
  local tests=${PIPESTATUS[0]}
  "$PYTHON" -P -m pytest -q -p no:cacheprovider tests/engine/kernels/test_triton_fused.py 2>&1 | tee -a "$OUT/gpu_tests_all.txt"
  tests=$((tests || PIPESTATUS[0]))
  if [ "${SMOKE:-0}" = 1 ]; then export TRITON_INTERPRET=1; fi
  "$PYTHON" -m bench.gpu.gpu_graphs --out "$OUT" --skip-smollm2 "${smoke[@]}" 2>&1 | grep -v "it/s\]"
  local graphs=${PIPESTATUS[0]}
  "$PYTHON" -m bench.gpu.gpu_fp8 --out "$OUT" "${smoke[@]}" 2>&1 | grep -v "it/s\]"
  local fp8=${PIPESTATUS[0]}
  unset TRITON_INTERPRET
  echo "gpu1: gpu tests rc=$tests, gpu_graphs rc=$graphs, gpu_fp8 rc=$fp8"
  return $((tests || graphs || fp8))
}

gpu2() {
  local equal=0 bench=0
  "$PYTHON" -P -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}" 2>&1 | tee "$OUT/gpu_tests_gpu2.txt"
  local tests=${PIPESTATUS[0]}
  if [ "${SMOKE:-0}" != 1 ]; then
    smollm2 --backends triton --dtypes float32 --hf-batches 128 || equal=1
    "$PYTHON" -m bench.gpu.gpu_graphs --out "$OUT/smollm2" --skip-decode 2>&1 | grep -v "it/s\]"
    bench=${PIPESTATUS[0]}
  fi
  echo "gpu2: gpu tests rc=$tests, smollm2 float32 rc=$equal, gpu_graphs smollm2 rc=$bench"
  return $((tests || equal || bench))
}

profile() {
  "$PYTHON" -m bench.gpu.gpu_step_profile run --out "$OUT" "${smoke[@]}" 2>&1 | grep -v "it/s\]"
  return "${PIPESTATUS[0]}"
}

case $stage in
  kernels) kernels || rc=1 ;;
  profile) profile || rc=1 ;;
  smollm2) smollm2 "${@:2}" || rc=1 ;;
  fused) fused || rc=1 ;;
  graphs) graphs || rc=1 ;;
  gpu1) gpu1 || rc=1 ;;
  gpu2) gpu2 || rc=1 ;;
  all) kernels || rc=1; smollm2 || rc=1 ;;
  *) echo "unknown stage $stage: kernels, smollm2 [ARGS], graphs, fused, profile or all" >&2; exit 2 ;;
esac
echo "stage $stage rc=$rc; output in $OUT"
exit $rc
