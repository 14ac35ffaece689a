"""``kvfleet engine`` flags: one EngineConfig from them, byte sizes, and bad values refused by name."""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import pytest

from kvfleet.engine import cli


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_flags_build_one_engine_config() -> None:
    config = cli.engine_config(
        _args(
            "--model", "/models/llama", "--served-model-name", "llama", "--max-num-seqs", "32",
            "--max-num-batched-tokens", "4096", "--target-step-ms", "250", "--block-size", "32", "--kv-cache-memory", "8GiB",
            "--num-kv-blocks", "100", "--max-model-len", "4096", "--dtype", "bfloat16", "--attention", "triton",
            "--no-prefix-caching", "--no-prepack-weights", "--weight-packing", "onednn", "--scheduling-policy", "priority", "--seed", "3",
            "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat", "--max-loras", "2",
            "--max-lora-rank", "8", "--max-cpu-loras", "4", "--structured-outputs-compile-timeout", "2.5", "-tp", "2", "--distributed-timeout-seconds", "12",
            "--enforce-eager", "--cuda-graph-sizes", "1", "8", "32", "--async-scheduling", "--no-profile-step-cost",
        )
    )  # fmt: skip
    assert config.model_dump() == {
        "model": "/models/llama",
        "served_model_name": "llama",
        "dtype": "bfloat16",
        "device": "auto",
        "seed": 3,
        "max_model_len": 4096,
        "block_size": 32,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 4096,
        "kv_cache_memory": 8 << 30,
        "gpu_memory_utilization": 0.9,
        "num_kv_blocks": 100,
        "enable_prefix_caching": False,
        "scheduling_policy": "priority",
        "attention_backend": "triton",
        "enable_chunked_prefill": True,
        "stall_free": True,
        "stall_free_factor": 2.0,
        "target_step_ms": 250.0,
        "profile_step_cost": False,
        "prepack_weights": False,
        "weight_packing": "onednn",
        "enforce_eager": True,
        "cuda_graph_sizes": [1, 8, 32],
        "async_scheduling": True,
        "enable_lora": False,
        "lora_modules": {"sql": "/adapters/sql", "chat": "/adapters/chat"},
        "max_loras": 2,
        "max_lora_rank": 8,
        "max_cpu_loras": 4,
        "structured_outputs_compile_timeout": 2.5,
        "tensor_parallel_size": 2,
        "distributed_timeout_seconds": 12.0,
        "quantization": None,
        "runner": "generate",
        "override_pooler_config": None,
    }
    assert config.lora_enabled
    default = cli.engine_config(_args("--model", "tiny"))
    assert default.prepack_weights and default.weight_packing == "auto"  # on, timed at load, unless told


def test_stall_free_is_the_default_and_no_stall_free_plans_by_the_token_cap_alone() -> None:
    default = cli.engine_config(_args("--model", "tiny"))
    assert (default.stall_free, default.stall_free_factor, default.target_step_ms) == (True, 2.0, None)
    assert default.plans_stall_free and default.profile_step_cost  # timed at start, unless told
    off = cli.engine_config(_args("--model", "tiny", "--no-stall-free"))
    assert not off.plans_stall_free
    with pytest.raises(ValueError, match="target_step_ms"):
        cli.engine_config(_args("--model", "tiny", "--no-stall-free", "--target-step-ms", "200"))


def test_the_pooling_flags_name_the_runner_as_vllm_does() -> None:
    pooling = cli.engine_config(
        _args(
            "--model", "tiny", "--runner", "pooling", "--override-pooler-config", '{"pooling_type": "MEAN"}'
        )
    )
    assert (pooling.runner, pooling.override_pooler_config) == ("pooling", {"pooling_type": "MEAN"})
    assert not pooling.plans_stall_free  # no steps to plan, no step profile at start
    assert cli.engine_config(_args("--model", "tiny", "--task", "embed")).runner == "pooling"
    with pytest.raises(ValueError, match="runner='pooling'"):
        cli.engine_config(_args("--model", "tiny", "--runner", "pooling", "-tp", "2"))
    with pytest.raises(SystemExit):
        _args("--override-pooler-config", "[1]")


def test_byte_sizes_take_binary_and_decimal_units() -> None:
    assert [cli.byte_size(s) for s in ("1024", "8GiB", "512MiB", "2G", "1.5k")] == [
        1024,
        8 << 30,
        512 << 20,
        2 * 10**9,
        1500,
    ]
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte size: 'lots'"):
        cli.byte_size("lots")


def test_memory_is_given_as_bytes_or_as_a_utilisation_not_both() -> None:
    with pytest.raises(SystemExit):
        _args("--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--block-size", "12"), "block_size must be a power of two, got 12"),
        (("--sim-gpu", "h900"), "unknown GPU 'h900'"),
        (("--sim-speedup", "0"), "sim_speedup must be > 0, got 0.0"),
    ],
)
def test_a_bad_value_exits_2_naming_it(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(_args("--simulate", "--num-kv-blocks", "8", "--port", "9", *flags)) == 2
    assert message in capsys.readouterr().err


def test_the_attention_backend_defaults_to_auto_and_takes_each_named_backend() -> None:
    assert cli.engine_config(_args("--model", "tiny")).attention_backend == "auto"
    for name in ("auto", "torch", "triton", "cpu"):
        assert cli.engine_config(_args("--model", "tiny", "--attention", name)).attention_backend == name


def test_an_unknown_attention_backend_is_refused_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _args("--attention", "flash")
    err = capsys.readouterr().err
    assert "argument --attention: invalid choice: 'flash'" in err
    assert all(name in err.split("choose from")[1] for name in ("auto", "torch", "triton", "cpu"))


def test_the_engine_holds_numpys_openblas_to_one_thread_unless_the_user_said_otherwise() -> None:
    probe = "import os, kvfleet.engine; print(os.environ['OPENBLAS_NUM_THREADS'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    # from /: python -c in the repository would import its operator/ folder for the stdlib's operator
    run = functools.partial(
        subprocess.run, [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert run(env=env).stdout.strip() == "1"
    assert run(env={**env, "OPENBLAS_NUM_THREADS": "4"}).stdout.strip() == "4"
