"""A GGUF checkpoint (llama.cpp's single-file format) converted once into a Hugging Face folder.

Where it sits: :func:`kvfleet.engine.loader.sources.resolve_model` sends ``--model FILE.gguf``
here; :func:`gguf_folder` returns a folder in the kvfleet cache (keyed by the file's path,
size and mtime) holding ``config.json``, float32 safetensors, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, which the loader and
:class:`~kvfleet.engine.tokenizer.hf.HFTokenizer` then read like any checkpoint. The folder
is built beside its final place and renamed in one step, so a failure leaves nothing behind.

Torch-free (numpy, ``gguf``, ``safetensors.numpy``): the API process converts through here
for its tokenizer, the engine core for its weights, and whichever comes first builds the folder.
Weights are dequantised with ``gguf.quants.dequantize``; the Q/K row permutation that llama.cpp's
``convert_hf_to_gguf`` applies to llama and mistral (not qwen2 nor qwen3) is undone; qwen3moe's
stacked expert tensors are split into one tensor per expert (:func:`split_experts`). Which
``general.architecture`` values are served, their Hugging Face names and their own tensors and
fields come from the architecture registry (``registry.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.model.registry import ArchitectureSpec, gguf_architecture, known_gguf_architectures
from kvfleet.engine.testing.tiny import cache_root
from kvfleet.engine.tokenizer.gguf import TokenizerMeta, tokenizer_files

CONVERTER_VERSION = "v1"  # part of the cache key: a converter fix rebuilds every folder
_Q = GGMLQuantizationType
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    *(_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1),
    *(_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K),
)
SHARD_BYTES = 2 * 1024**3
ROPE_FREQS = "rope_freqs.weight"
LLAMA3_ROPE = (1.0, 4.0, 8192)  # low_freq_factor, high_freq_factor, original_max_position_embeddings
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFModel(NamedTuple):
    """What the converter read from a GGUF file, before writing anything."""

    arch: str
    config: dict[str, Any]
    tokenizer: TokenizerMeta
    tensors: list[ReaderTensor]


def gguf_folder(path: Path, cache_dir: Path | None = None) -> Path:
    """The Hugging Face folder converted from the GGUF file ``path``, built on first use."""
    path = path.expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e.strerror})") from e
    key = hashlib.sha256(f"{CONVERTER_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    target = (cache_dir or cache_root()) / "gguf" / f"{path.stem}-{key[:16]}"
    return build_once(target, lambda staging: convert_gguf(path, staging))


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, built by ``build(staging)`` in a temporary folder beside it and renamed into place.

    Processes racing for the same cache take turns (a lock on the cache folder), so the
    second finds the first's folder instead of converting again."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(target.parent):
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            os.chmod(staging, 0o755)  # mkdtemp made it private; the cache is shared like any download
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def cache_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on a cache folder (flock on the folder itself: no lock file left behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def convert_gguf(path: Path, folder: Path) -> None:
    """Write the Hugging Face files for the GGUF checkpoint ``path`` into ``folder`` (which exists)."""
    model = read_gguf(path)
    config = model.config
    files = tokenizer_files(model.tokenizer, f"{path}", config["max_position_embeddings"])
    _write_json(folder / "config.json", config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(folder / "generation_config.json", generation)
    _write_json(folder / "tokenizer.json", files.tokenizer_json)
    _write_json(folder / "tokenizer_config.json", files.tokenizer_config)
    _write_weights(folder, _hf_tensors(path, model))


def read_gguf(path: Path) -> GGUFModel:
    """Parse and check the file: architecture, hyper-parameters, tensor names and types."""
    source = str(path)
    try:
        reader = GGUFReader(path)
        fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except (ValueError, OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{source}: not a readable GGUF file ({e})") from e
    arch = fields.get("general.architecture")
    spec = gguf_architecture(arch) if isinstance(arch, str) else None
    if spec is None:
        raise ModelLoadError(
            f"{source}: field general.architecture is {arch!r}; supported: {known_gguf_architectures()}"
        )
    tokenizer = _tokenizer_meta(fields, source)
    names = {t.name for t in reader.tensors}
    config = _hf_config(fields, spec, source, len(tokenizer.tokens), tied="output.weight" not in names)
    tensors = [t for t in reader.tensors if t.name != ROPE_FREQS]
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # llama3 rope scaling, written as its table of per-frequency factors
            config["rope_scaling"] = llama3_rope_scaling(np.asarray(t.data, dtype=np.float32), config, source)
    _check_tensors(tensors, spec, config, source)
    return GGUFModel(str(arch), config, tokenizer, tensors)


def llama3_rope_scaling(factors: np.ndarray, config: dict[str, Any], source: str) -> dict[str, Any]:
    """The llama3 ``rope_scaling`` whose factor table convert_hf_to_gguf wrote as ``rope_freqs.weight``.

    The table does not name its parameters; every Llama 3.1/3.2/3.3 uses low/high frequency factors
    1 and 4 over an 8192-token original context, so those are checked against it, not guessed."""
    factor = _f32(factors.max()) if factors.size else 1.0
    low, high, original = LLAMA3_ROPE
    expected = llama3_rope_factors(config["rope_theta"], config["head_dim"], factor, low, high, original)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ModelLoadError(
            f"{source}: tensor {ROPE_FREQS} is not llama3 rope scaling with low/high frequency factors "
            f"{low:g}/{high:g} over a {original}-token original context; no other rope frequency table is supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def llama3_rope_factors(
    theta: float, dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """convert_hf_to_gguf's table: 1 for short wavelengths, ``factor`` for long ones, smooth between."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    scaled = np.where(wavelen > original / low, factor, between)
    return np.where(wavelen < original / high, 1.0, scaled).astype(np.float32)


def _field(fields: dict[str, Any], key: str, source: str) -> Any:
    value = fields.get(key)
    if value is None:
        raise ModelLoadError(f"{source}: field {key} is missing")
    return value


def _hf_config(
    fields: dict[str, Any], spec: ArchitectureSpec, source: str, vocab: int, tied: bool
) -> dict[str, Any]:
    arch = str(spec.gguf_name)

    def need(key: str) -> Any:
        return _field(fields, f"{arch}.{key}", source)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelLoadError(f"{source}: field {arch}.attention.head_count_kv varies by layer; not supported")
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = fields.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(
            f"{source}: field {arch}.rope.dimension_count is {rope_dim}, the head is {head_dim} wide; "
            "only rope on every dim is supported"
        )
    eos = int(_field(fields, "tokenizer.ggml.eos_token_id", source))
    eot = [
        int(fields[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields
    ]
    eos_ids = sorted({eos, *eot})
    return {
        "architectures": [spec.name],
        "model_type": arch,
        "vocab_size": int(fields.get(f"{arch}.vocab_size") or vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(fields, arch, source),
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    } | _family_fields(spec, fields, arch, source)


def _family_fields(spec: ArchitectureSpec, fields: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    try:
        return spec.gguf_config(fields, arch)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from e


def _f32(value: Any) -> float:
    """A float32 field as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(fields: dict[str, Any], arch: str, source: str) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind is None and fields.get(f"{arch}.rope.scale_linear") is not None:  # the older spelling
        return {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scale_linear"])}
    if kind in (None, "none"):
        return None
    factor = float(_field(fields, f"{arch}.rope.scaling.factor", source))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(_field(fields, f"{arch}.rope.scaling.original_context_length", source))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ModelLoadError(
        f"{source}: field {arch}.rope.scaling.type is {kind!r}; supported: none, linear, yarn"
    )


def _tokenizer_meta(fields: dict[str, Any], source: str) -> TokenizerMeta:
    tokens = list(_field(fields, "tokenizer.ggml.tokens", source))
    keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    special_ids = {
        name: int(fields[f"tokenizer.ggml.{key}_token_id"])
        for name, key in keys.items()
        if f"tokenizer.ggml.{key}_token_id" in fields
    }
    model = str(_field(fields, "tokenizer.ggml.model", source))
    return TokenizerMeta(
        model=model,
        pre=fields.get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=list(fields.get("tokenizer.ggml.token_type") or []),
        scores=[float(s) for s in fields.get("tokenizer.ggml.scores") or []],
        merges=list(fields.get("tokenizer.ggml.merges") or []),
        special_ids=special_ids,
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=fields.get("tokenizer.chat_template"),
    )


def permuted_qk(arch: str) -> bool:
    """Whether convert_hf_to_gguf permuted this architecture's q/k rows for its rope."""
    spec = gguf_architecture(arch)
    return spec is not None and spec.gguf_permuted_qk


def hf_name(gguf_name: str, arch: str) -> str | None:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; None for a name not mapped
    (by the shared Llama names and the family's own, ``arch``'s, which win: Gemma's ``ffn_norm``)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer = _layer_names(arch).get(parts[2])
        return None if layer is None else f"model.layers.{parts[1]}.{layer}"
    return None


def _layer_names(arch: str) -> dict[str, str]:
    spec = gguf_architecture(arch)
    return _LAYER if spec is None else _LAYER | dict(spec.gguf_layer_tensors)


def norm_shift(arch: str, gguf_name: str) -> float:
    """What llama.cpp added to this tensor (Gemma's norms: 1), to subtract back."""
    spec = gguf_architecture(arch)
    return spec.gguf_norm_shift if spec is not None and gguf_name.endswith("norm.weight") else 0.0


def _check_tensors(
    tensors: list[ReaderTensor], spec: ArchitectureSpec, config: dict[str, Any], source: str
) -> None:
    arch = str(spec.gguf_name)
    for t in tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise ModelLoadError(
                f"{source}: tensor {t.name} has type {t.tensor_type.name}; supported: {supported}"
            )
    names = {t.name for t in tensors}
    unknown = sorted(n for n in names if hf_name(n, arch) is None)
    if unknown:
        raise ModelLoadError(f"{source}: tensors {unknown[:5]} are not part of a {arch} model")
    dense = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    layer_parts = [p for p in _LAYER if spec.gguf_dense_mlp or p not in dense] + list(spec.gguf_required)
    needed = [n for n in _GLOBAL if n != "output.weight" or not config["tie_word_embeddings"]]
    needed += [f"blk.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in layer_parts]
    missing = [n for n in needed if n not in names]
    if missing:
        raise ModelLoadError(f"{source}: tensors {missing[:5]} are missing ({len(missing)} in all)")


def _hf_tensors(path: Path, model: GGUFModel) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor dequantised to float32 in torch's (out, in) layout, q/k rows unpermuted."""
    heads, kv_heads = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    for t in model.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        try:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except (ValueError, IndexError) as e:
            raise ModelLoadError(f"{path}: tensor {t.name} cannot be read (a truncated file? {e})") from e
        if permuted_qk(model.arch) and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            array = unpermute_qk(array, heads if "attn_q" in t.name else kv_heads)
        shift = norm_shift(model.arch, t.name)
        if shift:
            array = array - np.float32(shift)
        name = str(hf_name(t.name, model.arch))
        if "{}" in name:  # llama.cpp's experts stacked (E, out, in): one tensor per expert
            yield from split_experts(name, array, model.config, f"{path}: tensor {t.name}")
        else:
            yield name, np.ascontiguousarray(array)


def split_experts(
    template: str, stacked: np.ndarray, config: dict[str, Any], what: str
) -> Iterator[tuple[str, np.ndarray]]:
    """A stacked (E, out, in) expert tensor as E tensors named ``template.format(expert)``."""
    if stacked.ndim != 3 or stacked.shape[0] != config["num_experts"]:
        raise ModelLoadError(
            f"{what} has shape {stacked.shape}; expected ({config['num_experts']}, out, in) stacked experts"
        )
    for expert, array in enumerate(stacked):
        yield template.format(expert), np.ascontiguousarray(array)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute``: per head, rows (pairs interleaved) back to two halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_weights(folder: Path, tensors: Iterator[tuple[str, np.ndarray]]) -> None:
    """Safetensors shards of at most ``SHARD_BYTES`` (one ``model.safetensors`` when it fits)."""
    shard: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        save_file(shard, str(folder / files[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, files[-1]))
        shard.clear()

    for name, array in tensors:
        if shard and sum(a.nbytes for a in shard.values()) + array.nbytes > SHARD_BYTES:
            flush()
        shard[name] = array
    flush()
    if len(files) == 1:
        os.rename(folder / files[0], folder / "model.safetensors")
    else:
        _write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
