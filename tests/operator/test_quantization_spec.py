"""spec.engine.quantization (issue #34): rendered as vLLM's --quantization for both engine kinds, counted
in CapacityFits by the format's bytes per weight, refused where the kind does not take it."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.operator.capacity_status import capacity_verdict
from kvfleet.operator.spec import SpecError, parse_inferenceservice

from .engine_flags import RENDERERS, assert_field_is_flag


def spec(engine: dict[str, Any], gpus: int = 1) -> Any:
    return parse_inferenceservice(
        {
            "model": {"name": "m", "uri": "file:///m", "architecture": "llama-3-70b", "maxModelLen": 8192},
            "engine": engine,
            "resources": {"gpus": gpus, "gpuType": "h100"},
        }
    )


@pytest.mark.parametrize("kind", sorted(RENDERERS))
def test_the_format_is_the_engines_quantization_flag(kind: str) -> None:
    assert_field_is_flag(spec, kind, "quantization", "fp8", "--quantization")


def test_capacity_fits_counts_fp8_weights_so_a_70b_model_fits_two_h100s_it_needs_four_for_in_bf16() -> None:
    # Llama-3-70B: ~141 GB of bf16 weights; in fp8 its decoder linears take one byte each (70.6 GB):
    # one H100 (72 GiB usable at 0.9) still cannot hold it with a KV cache, two can.
    assert capacity_verdict(spec({"quantization": "fp8"}, gpus=1))[0].status == "False"
    assert capacity_verdict(spec({"quantization": "fp8"}, gpus=2))[0].status == "True"
    bf16, fp8 = (capacity_verdict(spec(e, gpus=4))[0].figures for e in ({}, {"quantization": "fp8"}))
    assert fp8["weightsBytesPerGpu"] < 0.55 * bf16["weightsBytesPerGpu"]


def test_vllm_engines_refuse_kvfleets_cpu_int8_format_naming_the_field() -> None:
    with pytest.raises(SpecError, match="spec.engine.quantization"):
        spec({"kind": "vllm", "quantization": "int8"})


def test_an_unknown_format_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match="spec.engine.quantization"):
        spec({"quantization": "int4"})
