"""The pooler's settings from a checkpoint (sentence-transformers files, matryoshka keys) and the flag over them,
and the core's batching of an embeddings request by the token budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.engine.core.pooling import token_batches
from kvfleet.engine.model.pooler_config import PoolerConfig, resolve_pooler_config
from kvfleet.engine.sampling_params import RequestError


def _write(folder: Path, name: str, value: object) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(value))


def test_a_plain_decoder_pools_its_last_token_normalised(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"model_type": "llama"})
    assert resolve_pooler_config(tmp_path, None) == PoolerConfig("LAST", True)


def test_a_sentence_transformers_folder_says_its_pooling_and_normalisation(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"matryoshka_dimensions": [32, 64]})
    _write(tmp_path, "modules.json", [{"type": "sentence_transformers.models.Transformer", "path": ""},
                                       {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}])  # fmt: skip
    _write(
        tmp_path, "1_Pooling/config.json", {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    )
    cfg = resolve_pooler_config(tmp_path, None)
    assert cfg == PoolerConfig("MEAN", False, matryoshka=True, matryoshka_dimensions=(32, 64))
    assert resolve_pooler_config(tmp_path, {"pooling_type": "cls", "normalize": True}).pooling_type == "CLS"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"pooling_type": "MAX"}, "pooling_type"),
        ({"normalize": "yes"}, "normalize"),
        ({"softmax": True}, "softmax"),
    ],
)
def test_a_bad_override_names_its_key(tmp_path: Path, override: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_pooler_config(tmp_path, override)


def test_dimensions_are_refused_unless_the_model_truncates_to_them() -> None:
    with pytest.raises(RequestError, match="matryoshka") as plain:
        PoolerConfig().check_dimensions(16, 128)
    assert plain.value.field == "dimensions"
    with pytest.raises(RequestError, match=r"\[32, 64\]"):
        PoolerConfig(matryoshka=True, matryoshka_dimensions=(32, 64)).check_dimensions(16, 128)
    with pytest.raises(RequestError, match="between 1 and 128"):
        PoolerConfig(matryoshka=True).check_dimensions(129, 128)
    PoolerConfig(matryoshka=True).check_dimensions(16, 128)
    PoolerConfig().check_dimensions(None, 128)


def test_token_batches_keep_the_order_and_fit_the_budget() -> None:
    prompts = [[1] * n for n in (3, 4, 2, 9, 1, 1, 5)]
    runs = token_batches(prompts, budget=6)
    assert [p for run in runs for p in run] == prompts
    assert [[len(p) for p in run] for run in runs] == [[3], [4, 2], [9], [1, 1], [5]]
