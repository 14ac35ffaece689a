"""The kernels compile for an H100/H200 (sm_90) even here: Triton's own ptxas, no GPU or driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("aot_compile.py")


def test_attention_store_lora_and_fused_kernels_compile_for_sm90_at_llama_shapes(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile afresh, never reuse an earlier build
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "compiled 10 kernels"
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "paged_attention bf16 group=4 head_dim=128 block=16 max_q=512",
        "paged_attention bf16 group=4 head_dim=128 block=16 max_q=1",
        "paged_attention fp16 group=7 head_dim=256 block=32 max_q=64",
        "paged_attention bf16 group=4 head_dim=128 block=16 max_q=512 window",
        "paged_attention bf16 group=8 head_dim=64 block=16 max_q=512 window sinks",
        "store_kv fp32->bf16 kv_heads=8 head_dim=128 block=16",
        "lora bf16 rank=16",
        "add_rms_norm bf16 hidden=4096",
        "rope bf16 heads=9 head_dim=64",
        "silu_mul bf16 block=1024",
    ]
