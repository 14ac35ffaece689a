"""The CPU path choice (engine/kernels/native/cpu_features.py): pure decisions for both kinds of CPU."""

from kvfleet.engine.kernels.native.cpu_features import (
    AmxPermission,
    choose_cpu_paths,
    cpuinfo_flags,
    probe_cpu_paths,
)
from kvfleet.engine.kernels.native.quant_gemm import choose_path, cpu_paths_line

EPYC_AVX2 = frozenset(["fpu", "sse4_2", "avx", "fma", "avx2", "bmi2"])
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
        == "cpu kernels: avx2 (no avx512, amx unavailable: not in cpuinfo; best tier avx2)"
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
