"""Adapters through the engine's HTTP API: the official openai client with model=adapter, /v1/models,
run-time load and unload (vLLM's bodies), /load and /metrics, and bad input naming the field.

One real server (engine core in its own process) over a tiny transformers Llama with one adapter
given at start; the others are loaded through the API.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvfleet.engine import LLM, SamplingParams

from ...charts.test_metrics_contract import LORA_METRIC_LABELS, exported
from ..server.conftest import LiveServer, start_server, stop_server

PROMPT = [256, 72, 101, 108, 108, 111]
N = 6


@pytest.fixture(scope="module")
def server(lora_base: Path, adapters: dict[str, Path]) -> Iterator[LiveServer]:
    live = start_server(
        "--model", str(lora_base), "--served-model-name", "base", "--attention", "torch",
        "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"attn={adapters['attn-r4']}", simulate=False,
    )  # fmt: skip
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(lora_base: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    """Each model's greedy text from the offline engine (whose tokens equal peft's: test_lora_hf_equivalence)."""
    llm = LLM(
        model=str(lora_base), attention_backend="torch", num_kv_blocks=64, enable_lora=True, max_loras=3
    )
    for name in ("attn-r4", "mlp-r8"):
        llm.load_lora(name, str(adapters[name]))
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    models: list[str | None] = [None, "attn-r4", "mlp-r8"]
    outs = llm.generate([PROMPT] * 3, params, lora=models)
    return {m: o.outputs[0].text for m, o in zip(models, outs, strict=True)}


def complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def post(server: LiveServer, path: str, body: dict[str, object]) -> httpx.Response:
    with server.client() as c:
        return c.post(path, json=body)


def test_the_openai_client_names_an_adapter_as_its_model(
    client: openai.OpenAI, offline: dict[str | None, str]
) -> None:
    assert complete(client, "base") == offline[None]
    assert complete(client, "attn") == offline["attn-r4"] != offline[None]
    chat = client.chat.completions.create(
        model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert chat.model == "attn" and chat.choices[0].message.content is not None


def test_models_list_each_adapter_with_its_parent_and_path(
    client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards["base"]["parent"] is None
    assert (cards["attn"]["parent"], cards["attn"]["root"]) == ("base", str(adapters["attn-r4"]))


def test_an_adapter_loaded_at_run_time_serves_and_unloads(
    server: LiveServer, client: openai.OpenAI, adapters: dict[str, Path], offline: dict[str | None, str]
) -> None:
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(adapters["mlp-r8"])})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert complete(client, "mlp") == offline["mlp-r8"]
    lora = server.load()["lora"]
    assert isinstance(lora, dict) and lora["max_loras"] == 2 and "mlp" in lora["resident"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as gone:
        complete(client, "mlp")
    assert gone.value.body["code"] == "model_not_found" and gone.value.body["param"] == "model"  # type: ignore[index]
    assert "mlp" not in {m.id for m in client.models.list().data}


def test_bad_adapters_get_errors_naming_the_field_and_disturb_nothing(
    server: LiveServer, client: openai.OpenAI, adapters: dict[str, Path], tmp_path: Path
) -> None:
    before = (complete(client, "base"), complete(client, "attn"))
    big = {"lora_name": "big", "lora_path": str(adapters["mlp-r8"]).replace("mlp-r8", "nowhere")}
    cases = [
        ("/v1/load_lora_adapter", big, 400, "lora_path", "is not a folder"),
        ("/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": str(adapters["all-r2"])}, 400, "lora_name",
         "already loaded"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "field required"),
        ("/v1/unload_lora_adapter", {"lora_name": "ghost"}, 404, "lora_name", "no LoRA adapter named 'ghost'"),
    ]  # fmt: skip
    for path, body, status, param, message in cases:
        r = post(server, path, body)
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param) and message in error["message"], body
    assert (complete(client, "base"), complete(client, "attn")) == before


def test_an_adapter_in_use_cannot_be_unloaded(server: LiveServer, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="attn",
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # running now
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "attn"})
    stream.close()
    assert r.status_code == 409 and r.json()["error"]["code"] == "lora_in_use"
    server.wait_until(lambda: server.load()["num_running"] == 0, "the aborted stream to leave")


def test_load_and_metrics_report_the_adapters(server: LiveServer, client: openai.OpenAI) -> None:
    complete(client, "attn")
    lora = server.load()["lora"]
    assert isinstance(lora, dict) and lora["resident"] == ["attn"] and lora["waiting"] == []
    with server.client() as c:
        text = c.get("/metrics").text
    names = exported(text)
    assert {n: names[n].labels for n in LORA_METRIC_LABELS if n in names} == LORA_METRIC_LABELS
    assert 'kvfleet:lora_tokens_total{adapter="attn",kind="generation"}' in text
    assert 'max_lora="2"' in text
