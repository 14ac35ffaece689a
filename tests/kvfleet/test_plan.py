"""`kvfleet plan` as a user runs it: the installed console script in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.cli import main

KVFLEET = str(Path(sys.executable).with_name("kvfleet"))


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVFLEET, "plan", *args], capture_output=True, text=True, timeout=60)


def test_the_table_shows_each_figure_for_each_gpu_asked_for() -> None:
    out = _plan("--model", "Llama-3-8B", "--gpu", "h100,h200", "--context", "8192")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        lines[0]
        == "model llama-3-8b (8.03 B params), dtype bfloat16, context 8192, gpu-memory-utilization 0.9"
    )
    rows = {line[:22].strip(): line[22:].split() for line in lines[1:]}
    assert rows["weights"] == ["14.96", "GiB", "14.96", "GiB"]
    assert rows["KV bytes/token"] == ["131072", "131072"]
    assert rows["per GPU: weights"] == ["14.96", "GiB", "14.96", "GiB"]
    assert rows["KV tokens that fit"] == ["426320", "851072"]
    assert rows["max seqs at 8192"] == ["52", "103"]
    assert rows["decode tokens/s bound"] == ["2423.0", "3903.5"]
    assert rows["fits"] == ["yes", "yes"]


def test_json_for_one_gpu_is_one_object_with_the_documented_figures() -> None:
    out = _plan("--model", "llama-3-70b", "--gpu", "H100", "--tensor-parallel-size", "4", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert {
        k: plan[k] for k in ("weights_bytes", "kv_bytes_per_token", "kv_tokens", "max_concurrent_sequences")
    } == {
        "weights_bytes": 141_107_412_992,
        "kv_bytes_per_token": 327680,
        "kv_tokens": 447_520,
        "max_concurrent_sequences": 54,
    }
    assert (plan["weights_bytes_per_rank"], plan["kv_bytes_per_token_per_rank"]) == (35_278_831_616, 81920)
    assert plan["decode_tokens_per_s_bound"] == 54 * 3.35e12 / (35_278_831_616 + 54 * 8192 * 81920)


def test_json_for_several_gpus_is_a_list_in_the_order_given_and_says_what_does_not_fit() -> None:
    out = _plan("--model", "llama-3-70b", "--gpu", "l4,h200", "--context", "4096", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)
    assert [(p["gpu"], p["fits"], p["kv_tokens"]) for p in plans] == [
        ("L4 24GB", False, 0),
        ("H200 SXM 141GB", False, 0),
    ]
    assert "141107412992" in plans[0]["reason"]


def test_a_config_folder_is_planned_like_a_known_model(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_folder = json.loads(_plan("--model", str(tmp_path), "--gpu", "a100", "--json").stdout)
    by_name = json.loads(_plan("--model", "qwen2-7b", "--gpu", "a100", "--json").stdout)
    assert from_folder["num_params"] == by_name["num_params"] == 7_615_616_512
    assert from_folder["kv_tokens"] == by_name["kv_tokens"]


def test_bad_input_from_the_console_script_exits_2_with_a_clear_line_and_no_traceback() -> None:
    for args, message in [
        (
            ("--model", "llama-3-8b", "--gpu", "b200"),
            "kvfleet plan: error: unknown GPU 'b200': known GPUs are h100",
        ),
        (("--model", "llama-3-8b", "--gpu", "h100", "--context", "lots"), "invalid int value: 'lots'"),
    ]:
        out = _plan(*args)
        assert out.returncode == 2, args
        assert message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "nope", "--gpu", "h100"), "unknown model 'nope'"),
        (("--model", "llama-3-8b", "--gpu", "h100", "--dtype", "int4"), "unknown dtype 'int4'"),
        (("--model", "llama-3-8b", "--gpu", "h100", "--num-gpus", "0"), "num_gpus must be at least 1, got 0"),
        (("--model", "llama-3-8b", "--gpu", "h100", "--gpu-memory-utilization", "2"), "(0, 1], got 2.0"),
        (("--model", "llama-3-8b", "--gpu", "h100", "--context", "9000"), "context 9000 exceeds"),
        (("--model", "llama-3-8b", "--gpu", ","), "--gpu ',' names no GPU"),
    ],
)
def test_each_bad_value_returns_2_and_names_the_value(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
