"""The CPU path choice (engine/kernels/native/cpu_features.py): pure decisions for both kinds of CPU,
and the AMX permission asked once per process."""

import platform
import threading
import time

import pytest

import kvfleet.engine.kernels.native.cpu_features as cpu_features
from kvfleet.engine.kernels.native.cpu_features import (
    AmxPermission,
    Once,
    choose_cpu_paths,
    cpuinfo_flags,
    probe_cpu_paths,
    request_amx_permission,
)
from kvfleet.engine.kernels.native.int8_gemm import load_int8
from kvfleet.engine.kernels.native.quant_gemm import choose_path, cpu_paths_line

EPYC_AVX2 = frozenset(["fpu", "sse4_2", "avx", "fma", "avx2", "bmi2"])
EPYC_ZEN4 = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}  # no AMX
XEON_SPR = frozenset(
    [
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "amx_bf16",
        "amx_tile",
        "amx_int8",
    ]
)


def test_an_avx2_only_epyc_gets_avx2_and_no_amx_because_cpuinfo_lacks_it() -> None:
    paths = choose_cpu_paths(EPYC_AVX2, None)
    assert (paths.isa, paths.amx, paths.amx_reason) == ("avx2", False, "not in cpuinfo")
    assert (
        paths.describe("avx2")
        == "cpu kernels: avx2 (no avx512, amx unavailable: not in cpuinfo; best tier avx2); "
        "bf16: none (no avx512_bf16/amx_bf16: bf16 matmuls emulated, slower than float32; use --dtype float32); "
        "int8: avx2 (from 16 rows: onednn)"
    )


def test_a_sapphire_rapids_xeon_with_the_permission_granted_may_use_amx() -> None:
    paths = choose_cpu_paths(XEON_SPR, AmxPermission(True))
    assert (paths.isa, paths.amx) == ("avx512_vnni", True)
    assert "amx usable" in paths.describe("avx2")


def test_the_same_xeon_with_the_permission_refused_falls_back_without_amx() -> None:
    paths = choose_cpu_paths(XEON_SPR, AmxPermission(False, "errno 22: Invalid argument"))
    assert (paths.isa, paths.amx) == ("avx512_vnni", False)
    assert paths.amx_reason == "arch_prctl refused (errno 22: Invalid argument)"


def test_amx_listed_but_never_requested_is_not_chosen() -> None:
    assert not choose_cpu_paths(XEON_SPR, None).amx


def test_a_cpu_without_avx2_runs_the_portable_path() -> None:
    assert choose_cpu_paths(frozenset({"sse2"}), None).isa == "portable"


def test_cpuinfo_flags_are_read_from_the_first_flags_line() -> None:
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpuinfo_flags(text) == frozenset({"fpu", "avx2", "amx_tile"})


def test_this_machine_is_probed_and_named_in_one_line() -> None:
    paths = probe_cpu_paths()
    assert not paths.amx or {"amx_tile", "amx_int8"} <= paths.flags
    assert cpu_paths_line().startswith("cpu kernels: ")


def test_the_gguf_kernels_take_vnni_on_a_vnni_cpu_and_avx2_on_an_avx2_only_epyc() -> None:
    built = ("portable", "avx2", "avx512_vnni")
    assert choose_path(built, choose_cpu_paths(XEON_SPR, AmxPermission(True))) == "avx512_vnni"
    assert choose_path(built, choose_cpu_paths(EPYC_AVX2, None)) == "avx2"
    assert choose_path(("portable", "avx2"), choose_cpu_paths(XEON_SPR, None)) == "avx2"
    assert choose_path(built, choose_cpu_paths(frozenset(["sse2"]), None)) == "portable"


def test_bf16_and_int8_from_16_rows_run_on_amx_where_the_permission_is_granted() -> None:
    paths = choose_cpu_paths(XEON_SPR, AmxPermission(True))
    assert (paths.bf16.path, paths.bf16.note) == ("amx", "")
    assert (paths.int8.path, paths.int8.note) == ("avx512_vnni", "from 16 rows: onednn amx_int8")
    assert "bf16: amx; int8: avx512_vnni (from 16 rows: onednn amx_int8)" in paths.describe("avx512_vnni")


def test_bf16_falls_back_to_avx512_bf16_and_says_why_when_amx_is_refused() -> None:
    paths = choose_cpu_paths(XEON_SPR, AmxPermission(False, "errno 22: Invalid argument"))
    assert str(paths.bf16) == "avx512_bf16 (amx_bf16 refused: errno 22: Invalid argument)"
    assert str(paths.int8) == "avx512_vnni (from 16 rows: onednn)"  # no amx_int8 without the permission


def test_amx_listed_but_never_requested_leaves_bf16_on_avx512_bf16() -> None:
    paths = choose_cpu_paths(XEON_SPR, None)
    assert str(paths.bf16) == "avx512_bf16 (amx_bf16 refused: permission not requested)"


def test_an_epyc_with_avx512_bf16_and_no_amx_runs_bf16_there_without_a_note() -> None:
    paths = choose_cpu_paths(EPYC_ZEN4, None)
    assert (paths.bf16.path, paths.bf16.note, paths.amx) == ("avx512_bf16", "", False)
    assert paths.describe("avx512_vnni").endswith(
        "bf16: avx512_bf16; int8: avx512_vnni (from 16 rows: onednn)"
    )


def test_an_avx2_only_cpu_gets_no_bf16_path_and_is_told_to_use_float32() -> None:
    paths = choose_cpu_paths(EPYC_AVX2, None)
    assert paths.bf16.path == "none"
    assert "use --dtype float32" in paths.bf16.note
    assert str(paths.int8) == "avx2 (from 16 rows: onednn)"


def test_a_portable_cpu_gets_no_bf16_path_and_the_portable_int8_kernel() -> None:
    paths = choose_cpu_paths(frozenset({"sse2"}), None)
    assert (paths.bf16.path, paths.int8.path) == ("none", "portable")
    assert paths.describe("portable").endswith("int8: portable (from 16 rows: onednn)")


def test_this_machine_names_its_bf16_and_int8_paths_in_the_start_up_line() -> None:
    paths = probe_cpu_paths()
    expected = "avx512_bf16" if "avx512_bf16" in paths.flags else "none"
    if {"amx_tile", "amx_bf16"} <= paths.flags:
        expected = paths.bf16.path  # amx or avx512_bf16: the permission decides
    assert paths.bf16.path == expected
    assert f"; bf16: {paths.bf16}; int8: {paths.int8}" in cpu_paths_line()
    native = load_int8()
    assert native is None or native.path == paths.int8.path  # the line names the path the kernel runs


def fresh_permission(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has not asked yet, on x86_64 Linux (where alone arch_prctl is asked)."""
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_features, "_AMX_PERMISSION", Once(cpu_features._ask_amx_permission))


def test_the_amx_permission_is_asked_once_however_many_threads_ask_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def slow_grant() -> int:
        calls.append(1)
        time.sleep(0.05)  # every other thread arrives while the first request is in flight
        return 0

    monkeypatch.setattr(cpu_features, "arch_prctl_xtiledata", slow_grant)
    fresh_permission(monkeypatch)
    outcomes: list[AmxPermission] = []
    threads = [threading.Thread(target=lambda: outcomes.append(request_amx_permission())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(outcomes) == 8 and len(set(outcomes)) == 1


def test_a_refused_permission_is_remembered_with_its_errno_and_not_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(cpu_features, "arch_prctl_xtiledata", lambda: calls.append(1) or 22)
    fresh_permission(monkeypatch)
    first, second = request_amx_permission(), request_amx_permission()
    assert first == second == AmxPermission(False, "errno 22: Invalid argument") and len(calls) == 1


def test_this_machine_is_probed_once_and_its_permission_outcome_is_the_one_the_paths_were_chosen_from() -> (
    None
):
    paths = probe_cpu_paths()
    assert probe_cpu_paths() is paths
    if "amx_tile" in paths.flags:
        assert paths.amx == request_amx_permission().granted or not {"amx_tile", "amx_int8"} <= paths.flags
