"""``POST /v1/embeddings`` through the official ``openai`` client, against transformers' pooled hidden states.

The server runs the real tiny random decoder (a Hugging Face folder, here with ``is_matryoshka`` in its
config) with ``--runner pooling``; the reference is transformers' own forward of the same folder: the
last token's final hidden state, L2-normalised (the default pooler of a decoder), float32, 1e-5.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

if TYPE_CHECKING:
    from conftest import LiveServer

MODEL = "tiny-embed"  # conftest.EMBED_MODEL


@pytest.fixture(scope="module")
def reference(embed_folder: Path) -> Iterator[object]:
    hf = AutoModelForCausalLM.from_pretrained(embed_folder, torch_dtype=torch.float32).eval()

    def embed(ids: list[int], dims: int | None = None) -> np.ndarray:
        with torch.no_grad():
            last = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return F.normalize(last[:dims], dim=-1).numpy()

    yield embed


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(46)
    return [[256, *rng.integers(0, 256, size=int(rng.integers(1, 90))).tolist()] for _ in range(n)]


def test_embeddings_equal_transformers_last_token_hidden_state(pooling_server: LiveServer, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts(5)
    with _client(pooling_server) as client:
        out = client.embeddings.create(model=MODEL, input=prompts)
    assert [d.index for d in out.data] == list(range(5))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(p) for p in prompts)
    for d, p in zip(out.data, prompts, strict=True):
        np.testing.assert_allclose(
            np.array(d.embedding, dtype=np.float32), reference(p), rtol=1e-5, atol=1e-5
        )


def test_a_string_input_is_embedded_as_its_tokens(pooling_server: LiveServer) -> None:
    ids = pooling_server.state.tokenizer.encode("Once upon a time")
    with _client(pooling_server) as client:
        by_text = client.embeddings.create(model=MODEL, input="Once upon a time", encoding_format="float")
        by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert by_text.data[0].embedding == by_ids.data[0].embedding
    assert by_text.usage.prompt_tokens == len(ids)


def test_base64_carries_the_same_float32_vector(pooling_server: LiveServer) -> None:
    body = {"model": MODEL, "input": [[256, 1, 2, 3]]}
    with pooling_server.client() as c:
        floats = c.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
        packed = c.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"][0][
            "embedding"
        ]
    assert isinstance(packed, str)
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == floats


def test_dimensions_truncate_a_matryoshka_model_and_renormalise(
    pooling_server: LiveServer, reference
) -> None:  # type: ignore[no-untyped-def]
    prompt = _prompts(1)[0]
    with _client(pooling_server) as client:
        out = client.embeddings.create(model=MODEL, input=[prompt], dimensions=16)
    got = np.array(out.data[0].embedding, dtype=np.float32)
    assert got.shape == (16,)
    np.testing.assert_allclose(got, reference(prompt, 16), rtol=1e-5, atol=1e-5)


def test_256_inputs_in_one_request_come_back_in_order(pooling_server: LiveServer, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts(256)  # about 11k tokens: many batches of at most 512 tokens in the core
    with _client(pooling_server) as client:
        out = client.embeddings.create(model=MODEL, input=prompts)
    assert len(out.data) == 256 and [d.index for d in out.data] == list(range(256))
    for i in (0, 1, 77, 128, 255):
        np.testing.assert_allclose(
            np.array(out.data[i].embedding, dtype=np.float32), reference(prompts[i]), rtol=1e-5, atol=1e-5
        )


def test_a_pooling_engine_refuses_generation_naming_model(pooling_server: LiveServer) -> None:
    with pooling_server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model" and "--runner pooling" in r.json()["error"]["message"]


def test_a_generating_engine_refuses_embeddings_naming_the_runner(fast_server: LiveServer) -> None:
    with fast_server.client() as c:
        r = c.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and "--runner pooling" in r.json()["error"]["message"]


def test_an_unknown_model_is_a_404(pooling_server: LiveServer) -> None:
    with pooling_server.client() as c:
        r = c.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
