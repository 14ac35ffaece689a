"""``--quantization gguf``: SmolLM2's Q4_1 GGUF served with its linears in their blocks.

The quantised model must hold its weights in at most 150 MB (float32: 538 MB), answer chat
prompts coherently through ``LLM(...)``, and its linears must be exactly the dequantised
float32 model's weights (the only difference left is the kernel's int8 activations)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams, cli
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.quant_linear import QuantLinear, dequantised
from kvfleet.engine.loader.gguf_loader import QuantEmbedding, quantized_source, resident_weight_bytes
from kvfleet.engine.loader.hf_loader import load_model
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.model.config import ModelLoadError
from kvfleet.engine.model.llama import DecoderLayer
from kvfleet.engine.testing.tiny import ensure_tiny_model


def test_int8_and_fp8_are_accepted_by_the_config() -> None:
    for kind in ("int8", "fp8"):
        assert EngineConfig(quantization=kind).quantization == kind


def test_the_gguf_flag_takes_lora_and_several_ranks_from_the_command_line() -> None:
    """Once refused (the GGUF loader did not shard): LoRA wraps every method and every loader shards
    (served: tests/engine/parallel/test_tp_gguf.py, tests/engine/layers/test_lora_over_methods.py)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = ["--model", "smollm2", "--quantization", "gguf", "--enable-lora", "--tensor-parallel-size", "2"]
    config = cli.engine_config(parser.parse_args(flags))
    assert (config.quantization, config.lora_enabled, config.tensor_parallel_size) == ("gguf", True, 2)


def test_a_hugging_face_folder_is_not_a_gguf_source() -> None:
    with pytest.raises(ModelLoadError, match="serves a GGUF checkpoint"):
        quantized_source(str(ensure_tiny_model()))


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core box: no spin-waiting threads
    try:
        yield LLM("smollm2", quantization="gguf", max_model_len=512, num_kv_blocks=64)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_smollm2_quantized_holds_at_most_150_mb_and_decodes_in_one_native_call(llm: LLM) -> None:
    model = llm.engine.runner.model
    assert resident_weight_bytes(model) <= 150e6
    fused = model.fused_decode()
    assert fused is not None and len(fused.native.operands) == model.config.num_layers
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert isinstance(layer.mlp.matmuls().inputs, QuantLinear)
    assert isinstance(model.lm_head_matmul(), QuantLinear)  # tied: the embedding's Q8_0 blocks


@pytest.mark.slow
def test_smollm2_quantized_answers_chat_prompts(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    # Not "Which city is ..." / "What is the capital of France?": float32 itself (the same weights
    # dequantised) answers them "The capital ... Paris" by a first-token margin of 0.03 / 0.08 nats
    # over "Le" / "L'", which any int8 activation quantisation flips (llama.cpp's Q8_1 scheme too);
    # this prompt's margin is 1.4 nats in float32 and 1.6 quantised.
    chats = ["Name the capital of France.", "Name three primary colors."]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=32))
    paris, colours = (o.outputs[0].text for o in outs)
    assert "Paris" in paris
    assert all(c in colours for c in ("Red", "Blue", "Yellow"))


@pytest.mark.slow
def test_the_blocks_are_the_float_models_weights_unpermuted(llm: LLM) -> None:
    quant = llm.engine.runner.model
    floats = load_model(resolve_model("smollm2"), torch.float32, torch.device("cpu"))
    for i in (0, len(floats.model.layers) - 1):
        lq, lf = quant.model.layers[i], floats.model.layers[i]
        assert isinstance(lq, DecoderLayer) and isinstance(lf, DecoderLayer)
        for bq, bf in ((lq.self_attn, lf.self_attn), (lq.mlp, lf.mlp)):
            inputs, output = bq.matmuls()
            assert isinstance(inputs, QuantLinear) and isinstance(output, QuantLinear)
            assert torch.equal(dequantised(inputs.weight), bf.fused_inputs().weight)
            assert torch.equal(dequantised(output.weight), bf.output_linear().weight)
    ids = torch.tensor([0, 17, 49151])
    assert torch.equal(quant.model.embed_tokens(ids), floats.model.embed_tokens(ids))
