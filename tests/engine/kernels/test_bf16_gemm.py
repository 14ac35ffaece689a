"""The bf16-weight CPU matmul (csrc/bf16_gemm.c) against a plain torch reference, on every path here.

The reference: the same bf16-rounded weights and the activations rounded to bf16 as the kernel
rounds them, multiplied in float64. Each product of two bf16 numbers is exact in float32, so a
path differs from it only by the rounding of its float32 sums (k <= 1536 terms of |sum| ~ 1: a few
1e-6), at SmolLM2-135M's real shapes (packed q/k/v, o, packed gate/up, down, the LM head) and a
shape that needs padding, at 1, 7, 8, 33 and 64 rows, with and without bias."""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from kvfleet.engine.kernels.native import bf16_gemm
from kvfleet.engine.kernels.native.cpu_features import choose_cpu_paths
from kvfleet.engine.layers.linear import get_method, registered
from kvfleet.engine.layers.linear.bf16 import Bf16Linear
from kvfleet.engine.layers.linear.config import bf16_config

native = bf16_gemm.load_bf16()
pytestmark = pytest.mark.skipif(native is None, reason="the native library does not build here")
# the paths this build has and this CPU runs (amx only where the process was granted the tiles)
HERE = () if native is None else tuple(p for p in native.paths if p != "amx" or native.path == "amx")
SHAPES = {  # (out, in) of SmolLM2-135M's matmuls, and one that pads both sizes
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
    "odd": (37, 45),
}


@functools.cache
def operands(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = SHAPES[shape]
    g = torch.Generator().manual_seed(n + k)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


@functools.cache
def panels(shape: str) -> bf16_gemm.Bf16Weight:
    return bf16_gemm.pack_panels(operands(shape)[0])


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.bfloat16().double() @ w.bfloat16().double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_path_here_gives_the_float64_product_of_the_bf16_rounded_operands(
    shape: str, rows: int, with_bias: bool
) -> None:
    assert native is not None
    w, b = operands(shape)
    bias = b if with_bias else None
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    want = reference(x, w, bias)
    assert len(HERE) >= 1 and "portable" in HERE
    for path in HERE:
        got = native(x, panels(shape), bias, path=path)
        assert got.dtype == torch.float32 and got.shape == (rows, w.shape[0])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5, msg=f"path {path}")


@pytest.mark.parametrize("rows", [130, 300])
@pytest.mark.parametrize("shape", ["qkv", "down", "odd"])
def test_a_prompt_chunk_of_hundreds_of_rows_gives_the_same_product(shape: str, rows: int) -> None:
    """Past 32 rows AMX walks chunks of panels against every block of rows: the same sums."""
    assert native is not None
    w, b = operands(shape)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    want = reference(x, w, b)
    for path in HERE:
        got = native(x, panels(shape), b, path=path)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5, msg=f"path {path}")


def test_the_paths_agree_with_each_other_to_float32_rounding() -> None:
    assert native is not None
    w, b = operands("down")
    x = torch.randn(33, w.shape[1])
    outs = [native(x, panels("down"), b, path=p) for p in HERE]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=2e-5)


def test_the_panels_hold_the_weight_rounded_to_bf16_as_torch_rounds_it() -> None:
    w = torch.randn(37, 45) * 3
    w[0, 0], w[1, 1] = 1.0 + 2**-8, 1.0 + 3 * 2**-8  # ties: to even (1.0), and up (1.0 + 2^-6)
    packed = bf16_gemm.pack_panels(w)
    assert packed.panels.shape == (3, 32, 16, 2)  # 37 -> 48 columns, 45 -> 64 of k in pairs
    assert torch.equal(packed.dense(), w.bfloat16())
    assert packed.dense()[0, 0].item() == 1.0 and packed.dense()[1, 1].item() == 1.0 + 2**-6
    assert packed.panels[2, :, 5:].abs().sum() == 0 and packed.panels[:, 23:].abs().sum() == 0


def test_the_one_call_step_switches_to_amx_at_the_same_row_count_as_the_per_op_path() -> None:
    source = (Path(bf16_gemm.__file__).parent / "csrc" / "decode_layers.c").read_text()
    found = re.search(r"#define BF16_AMX_MIN_ROWS (\d+)", source)
    assert found is not None and int(found.group(1)) == bf16_gemm.AMX_MIN_ROWS


def test_a_call_of_fewer_than_amx_min_rows_takes_avx512_bf16_where_amx_is_the_best_path() -> None:
    assert native is not None
    amx = object.__new__(bf16_gemm.NativeBf16)
    amx.paths, amx.path = bf16_gemm.PATHS, "amx"
    assert [amx.path_for(r) for r in (1, bf16_gemm.AMX_MIN_ROWS - 1, bf16_gemm.AMX_MIN_ROWS, 64)] == [
        "avx512_bf16",
        "avx512_bf16",
        "amx",
        "amx",
    ]
    assert native.path_for(1) in HERE and native.path_for(64) in HERE


@pytest.mark.parametrize(
    ("flags", "granted", "want"),
    [
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, True, "amx"),
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, False, "avx512_bf16"),
        ({"avx2", "avx512f", "avx512_bf16"}, None, "avx512_bf16"),
        ({"avx2", "avx512f"}, None, "portable"),
        ({"avx2"}, None, "portable"),
    ],
)
def test_the_path_is_the_best_the_cpu_runs_amx_only_where_granted(
    flags: set[str], granted: bool | None, want: str
) -> None:
    from kvfleet.engine.kernels.native.cpu_features import AmxPermission

    amx = None if granted is None else AmxPermission(granted, "" if granted else "refused")
    assert bf16_gemm.choose_bf16_path(bf16_gemm.PATHS, choose_cpu_paths(frozenset(flags), amx)) == want
    assert bf16_gemm.choose_bf16_path(("portable",), choose_cpu_paths(frozenset(flags), amx)) == "portable"


def test_bad_operands_are_refused_with_the_reason() -> None:
    assert native is not None
    packed = panels("odd")
    with pytest.raises(bf16_gemm.Bf16KernelError, match="45 columns"):
        native(torch.randn(2, 44), packed)
    with pytest.raises(bf16_gemm.Bf16KernelError, match="float32"):
        native(torch.randn(2, 45, dtype=torch.float64), packed)
    if native.path != "amx":
        with pytest.raises(bf16_gemm.Bf16KernelError, match="does not run here"):
            native(torch.randn(2, 45), packed, path="amx")


def test_the_bf16_method_is_registered_and_its_linear_keeps_the_input_shape() -> None:
    assert "bf16" in registered()
    method = get_method("bf16")
    w, b = operands("odd")
    kernel = method.load([method.quantize(w[:20]), method.quantize(w[20:])], b)
    assert isinstance(kernel, Bf16Linear)
    x = torch.randn(2, 3, 45)
    with torch.inference_mode():
        got = kernel(x)
    assert got.shape == (2, 3, 37)
    torch.testing.assert_close(got.reshape(6, 37).double(), reference(x.reshape(6, 45), w, b))
    op = kernel.native_operand()
    assert op is not None and op.kind == "bf16" and op.weight.dtype == torch.bfloat16 and op.max_rows is None


def test_the_bf16_method_shards_rows_and_columns_and_embeds_in_float32() -> None:
    method = get_method("bf16", torch.float32)
    w, _ = operands("odd")
    full = method.quantize(w)
    assert torch.equal(method.shard(full, 0, slice(16, 37)).dense(), w[16:].bfloat16())
    assert torch.equal(method.shard(full, 1, slice(0, 20)).dense(), w[:, :20].bfloat16())
    embedding = method.embedding(full)
    assert isinstance(embedding, nn.Embedding)
    rows = embedding(torch.tensor([[3, 0]]))
    assert rows.dtype == torch.float32 and torch.equal(rows[0], w[[3, 0]].bfloat16().float())


def test_only_a_bf16_engine_on_the_cpu_gets_the_bf16_method() -> None:
    cpu = torch.device("cpu")
    config = bf16_config(cpu, torch.bfloat16)
    assert config is not None and config.method == "bf16" and config.stored == "float"
    assert config.compute_dtype(torch.bfloat16) == torch.float32
    assert native is not None and native.path in config.source
    assert bf16_config(cpu, torch.float32) is None
    assert bf16_config(torch.device("cuda"), torch.bfloat16) is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-march=x86-64-v3 names an x86_64 CPU")
def test_on_a_cpu_without_avx512_the_library_builds_the_portable_path_alone_and_it_is_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16_gemm.c built for an AVX2 machine (``-march=x86-64-v3``: no AVX-512, no AMX) has the
    portable path only, and it gives the reference's product there too."""
    import ctypes

    from kvfleet.engine.kernels.native import build

    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path))
    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in build.FLAGS)
    built = build.build_library(flags)
    assert built.library is not None, built.reason
    assert isinstance(built.library, ctypes.CDLL)
    avx2 = bf16_gemm.NativeBf16(built.library)
    assert avx2.paths == ("portable",) and avx2.path == "portable"
    w, b = operands("odd")
    x = torch.randn(9, w.shape[1])
    torch.testing.assert_close(avx2(x, panels("odd"), b).double(), reference(x, w, b), rtol=1e-5, atol=2e-5)
