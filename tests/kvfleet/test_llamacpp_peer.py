"""The pure parts of the llama.cpp peer bench (issue #34): the instruction-set flags llama-server is built
with (bench/peers/llamacpp_flags.py) and the report's ratios and targets (bench/peers/llamacpp_report.py).
The bench itself serves real models and is not run here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvfleet.engine.kernels.native.cpu_features import AmxPermission

ROOT = Path(__file__).resolve().parents[2]  # bench/ is a package run from the repository root
AVX2 = frozenset({"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"})
ZEN4 = AVX2 | {
    "avx512f",
    "avx512cd",
    "avx512vl",
    "avx512dq",
    "avx512bw",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_bf16",
}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


def bench_module(name: str) -> ModuleType:
    added = str(ROOT) not in sys.path
    if added:
        sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(str(ROOT))


@pytest.fixture(scope="module")
def flags() -> ModuleType:
    return bench_module("bench.peers.llamacpp_flags")


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return bench_module("bench.peers.llamacpp_report")


def on(flags: ModuleType, cpu: frozenset[str], amx: AmxPermission | None) -> set[str]:
    return {c.option for c in flags.isa_flags(cpu, amx) if c.on}


def test_an_avx512_cpu_without_amx_gets_avx512_and_vnni_and_never_amx(flags: ModuleType) -> None:
    chosen = on(flags, ZEN4, None)
    assert {
        "GGML_AVX2",
        "GGML_FMA",
        "GGML_F16C",
        "GGML_AVX512",
        "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16",
    } <= chosen
    assert not chosen & {"GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "GGML_AVX_VNNI"}


def test_an_avx2_only_cpu_gets_no_avx512_option(flags: ModuleType) -> None:
    chosen = on(flags, AVX2, None)
    assert chosen == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C"}


def test_avx512_needs_every_subset_ggml_compiles_for(flags: ModuleType) -> None:
    choices = {c.option: c for c in flags.isa_flags(ZEN4 - {"avx512bw"}, None)}
    assert not choices["GGML_AVX512"].on
    assert "avx512bw" in choices["GGML_AVX512"].why


def test_amx_listed_but_refused_by_arch_prctl_stays_off_and_says_why(flags: ModuleType) -> None:
    choices = flags.isa_flags(SAPPHIRE_RAPIDS, AmxPermission(False, "errno 22: Invalid argument"))
    amx = [c for c in choices if c.option.startswith("GGML_AMX")]
    assert amx and not any(c.on for c in amx)
    assert all("refused" in c.why and "errno 22" in c.why for c in amx)


def test_amx_is_on_only_when_listed_granted_and_asked_for(flags: ModuleType) -> None:
    amx = {"GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}
    assert amx <= {
        c.option for c in flags.isa_flags(SAPPHIRE_RAPIDS, AmxPermission(True), llama_amx=True) if c.on
    }
    assert not amx & {c.option for c in flags.isa_flags(ZEN4, AmxPermission(True), llama_amx=True) if c.on}


def test_amx_granted_stays_off_by_default_and_says_llama_cpp_dies_with_sigill(flags: ModuleType) -> None:
    choices = [
        c for c in flags.isa_flags(SAPPHIRE_RAPIDS, AmxPermission(True)) if c.option.startswith("GGML_AMX")
    ]
    assert choices and not any(c.on for c in choices)
    assert all("SIGILL" in c.why for c in choices)


def test_the_cmake_line_never_asks_for_a_native_build_and_names_every_isa_option(flags: ModuleType) -> None:
    line = flags.cmake_flags(flags.isa_flags(ZEN4, None))
    assert "-DGGML_NATIVE=OFF" in line and "-DGGML_CUDA=OFF" in line and "-DCMAKE_BUILD_TYPE=Release" in line
    named = {d.split("=")[0].removeprefix("-D") for d in line}
    assert set(flags.GGML_ISA) | set(flags.GGML_AMX) <= named


def cell(
    report: ModuleType, server: str, c: int, tokens: int, ttft_p99: float, itl_p99: float = 0.05
) -> object:
    return report.Cell(server, c, 10.0, tokens, (ttft_p99 / 2, ttft_p99), (itl_p99 / 2, itl_p99))


def test_ratios_are_over_llamacpp_at_the_same_concurrency_and_judge_both_targets(report: ModuleType) -> None:
    cells = [
        cell(report, "llama.cpp", 1, 1000, 0.2),
        cell(report, "llama.cpp", 4, 2000, 0.4),
        cell(report, "kvfleet gguf", 1, 1500, 0.2),  # 1.5x, same TTFT p99: both met
        cell(report, "kvfleet gguf", 4, 1000, 0.8),  # 0.5x, 2x TTFT p99: neither
    ]
    lines = report.ratio_lines(cells)
    assert "c=1   output 1.50x (met), TTFT p99 1.00x (met)" in lines[1]
    assert "c=4   output 0.50x (NOT met), TTFT p99 2.00x (NOT met)" in lines[2]
    assert report.targets_summary(cells, "kvfleet gguf") == (
        "kvfleet gguf: output >= 1.5x met in 1 of 2 cells, TTFT p99 <= llama.cpp's in 1 of 2"
    )


def test_a_cell_without_a_llamacpp_cell_of_its_concurrency_gets_no_ratio(report: ModuleType) -> None:
    cells = [cell(report, "llama.cpp", 1, 1000, 0.2), cell(report, "kvfleet float32", 4, 500, 0.3)]
    assert report.ratio_lines(cells)[1:] == []


def test_a_table_row_shows_tokens_per_second_milliseconds_the_cpu_use_before_and_the_load_average(
    report: ModuleType,
) -> None:
    row = report.row_line(
        report.Cell("llama.cpp", 4, 8.0, 1000, (0.1, 0.25), (0.02, 0.05), 0, (1.0, 0.5, 0.25), 0.1)
    )
    assert row.split() == ["llama.cpp", "4", "125.0", "100/250", "20/50", "0", "10%", "1.00", "0.50", "0.25"]


def test_kvfleet_is_judged_over_vllm_bf16_at_the_same_concurrency_and_vllm_is_never_judged(
    report: ModuleType,
) -> None:
    cells = [
        cell(report, "llama.cpp", 1, 1000, 0.2),
        cell(report, "vLLM bf16", 1, 1000, 0.4),
        cell(report, "vLLM bf16", 4, 2000, 0.4),
        cell(report, "kvfleet gguf", 1, 1500, 0.2),  # 1.5x vLLM's: met
        cell(report, "kvfleet gguf", 4, 2000, 0.2),  # 1.0x: not met
    ]
    lines = report.vllm_lines(cells)
    assert lines[0].startswith("ratios over vLLM bf16")
    assert "kvfleet gguf     c=1   output 1.50x (met), TTFT p99 0.50x" in lines[1]
    assert "kvfleet gguf     c=4   output 1.00x (NOT met)" in lines[2]
    assert len(lines) == 3
    assert all("vLLM" not in line for line in report.ratio_lines(cells)[1:])
    assert report.vllm_lines([c for c in cells if c.server != "vLLM bf16"]) == []
