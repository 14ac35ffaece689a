"""Adapters the engine refuses, each with an error naming the field, and nothing else disturbed."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.lora.config import LoraError, parse_lora_modules
from kvfleet.engine.sampling_params import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [256, 72, 101, 108, 108, 111]


def broken_copy(adapter: Path, folder: Path, **config_changes: object) -> Path:
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llm(lora_base: Path, adapters: dict[str, Path]) -> LLM:
    return LLM(
        model=str(lora_base),
        attention_backend="torch",
        num_kv_blocks=64,
        lora_modules={"attn-r4": str(adapters["attn-r4"])},
        max_loras=2,
        max_lora_rank=8,
    )


def answers(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], GREEDY, lora=[None, "attn-r4"])]


def test_bad_adapters_are_refused_naming_the_field_and_leave_the_others_answering_as_before(
    llm: LLM, adapters: dict[str, Path], tmp_path: Path
) -> None:
    before = answers(llm)
    corrupt = broken_copy(adapters["mlp-r8"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00not safetensors")
    no_config = broken_copy(adapters["mlp-r8"], tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    cases = {
        "too-big": (broken_copy(adapters["mlp-r8"], tmp_path / "r16", r=16), "above --max-lora-rank=8", 400),
        "alien": (
            broken_copy(adapters["mlp-r8"], tmp_path / "alien", target_modules=["c_attn"]),
            "c_attn",
            400,
        ),
        "corrupt": (corrupt, "not a readable safetensors", 400),
        "no-config": (no_config, "has no adapter_config.json", 400),
        "nowhere": (tmp_path / "missing", "is not a folder", 400),
        "attn-r4": (adapters["attn-r4"], "already loaded", 400),
    }
    for name, (path, message, status) in cases.items():
        with pytest.raises(LoraError) as err:
            llm.load_lora(name, str(path))
        assert err.value.field in ("lora_path", "lora_name") and message in err.value.reason, name
        assert err.value.status == status
    shape = broken_copy(adapters["mlp-r8"], tmp_path / "shape", r=4)  # config says 4, matrices hold 8
    with pytest.raises(LoraError, match="is the adapter for another base model"):
        llm.load_lora("shape", str(shape))
    assert sorted(llm.engine.stats().lora.known) == ["attn-r4"]  # type: ignore[union-attr]
    assert answers(llm) == before


def test_requests_for_unknown_adapters_and_bad_unloads_are_refused(llm: LLM) -> None:
    with pytest.raises(RequestError) as err:
        llm.generate([PROMPT], GREEDY, lora="nobody")
    assert err.value.field == "model" and "no LoRA adapter named 'nobody'" in err.value.reason
    with pytest.raises(LoraError) as unknown:
        llm.unload_lora("nobody")
    assert (unknown.value.status, unknown.value.code) == (404, "model_not_found")
    llm.engine.add_request("busy", PROMPT, GREEDY, lora="attn-r4")
    with pytest.raises(LoraError) as busy:
        llm.unload_lora("attn-r4")
    assert (busy.value.status, busy.value.field) == (409, "lora_name")
    llm.engine.abort("busy")


def test_a_loaded_adapter_serves_until_unloaded(llm: LLM, adapters: dict[str, Path]) -> None:
    base = answers(llm)[0]
    llm.load_lora("later", str(adapters["all-r2"]))
    (out,) = llm.generate([PROMPT], GREEDY, lora="later")
    assert out.outputs[0].token_ids != base
    llm.unload_lora("later")
    with pytest.raises(RequestError, match="later"):
        llm.generate([PROMPT], GREEDY, lora="later")
    assert answers(llm)[0] == base


def test_a_base_model_name_that_differs_is_a_warning_not_a_refusal(
    llm: LLM, adapters: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = broken_copy(
        adapters["attn-r4"], tmp_path / "other", base_model_name_or_path="meta-llama/Llama-3-8B"
    )
    with caplog.at_level(logging.WARNING, logger="kvfleet.engine.lora.config"):
        llm.load_lora("other-base", str(other))
    assert "base_model_name_or_path is 'meta-llama/Llama-3-8B'" in caplog.text
    llm.unload_lora("other-base")


def test_an_engine_without_lora_refuses_adapters(lora_base: Path, adapters: dict[str, Path]) -> None:
    plain = LLM(model=str(lora_base), attention_backend="torch", num_kv_blocks=16)
    with pytest.raises(LoraError, match="--enable-lora"):
        plain.load_lora("a", str(adapters["attn-r4"]))
    assert plain.engine.stats().lora is None


def test_lora_modules_flags_parse_name_equals_path() -> None:
    assert parse_lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
