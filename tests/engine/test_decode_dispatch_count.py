"""How many torch operations one decode step dispatches per decoder layer (tiny model, CPU): pinned,
so a change that adds kernel launches to the decode path fails here and says so (issue #30)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.runner.cuda_graphs import PaddedStep

# Per decoder layer, one decode step of 2 sequences on the per-op path (torch attention backend).
# On float32 CPU tensors the matmuls (the few-row GEMM), add+RMSNorm, RoPE and SiLU x up are native
# calls that never reach torch's dispatcher; what is counted is the rest: the q/k/v split and head
# views, the K/V store (2 index_put_), and the batched attention's plan and call (its index tensors
# built from Python lists: 5 lift_fresh + 5 detach_, the block gather, the causal mask, one SDPA).
# On a GPU every one of these is a launch (or a host-side view): a change that adds ops fails here.
PER_OP_LAYER_OPS = 88
# The native fused decode (cpu backend): no decoder layer's module runs; the whole step's ops are the
# embedding, RoPE's cos/sin, the step checks (5 item() reads of the bounds), the final norm and the LM head.
FUSED_STEP_OPS = 85


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _count_decode_step(backend: str) -> tuple[Counter[str], Counter[str]]:
    """(ops inside decoder layer 0, ops inside all the layers) of the first 2-row decode step."""
    # native packing: "auto" times the packers at load, and only native-packed weights take the fused call
    llm = LLM("tiny", attention_backend=backend, num_kv_blocks=64, weight_packing="native")
    runner: Any = llm.engine.runner
    layers = runner.model.model.layers
    counted: dict[str, Count] = {}
    run = runner.decode.graphs.run

    def counting(shape: PaddedStep) -> torch.Tensor:
        if counted:
            return run(shape)
        first, every = Count(), Count()
        counted.update(first=first, every=every)
        hooks = [  # the hooks return None: a value would replace the layer's inputs or output
            layers[0].register_forward_pre_hook(lambda *_: None if first.__enter__() else None),
            layers[0].register_forward_hook(lambda *_: None if first.__exit__(None, None, None) else None),
        ]
        try:
            with every:
                return run(shape)
        finally:
            for h in hooks:
                h.remove()

    runner.decode.graphs.run = counting
    llm.generate(["hello", "world!"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    return counted["first"].ops, counted["every"].ops


def test_one_decode_step_dispatches_a_pinned_number_of_torch_ops_per_decoder_layer() -> None:
    first, every = _count_decode_step("torch")
    assert sum(first.values()) == PER_OP_LAYER_OPS, sorted(first.items())


def test_the_native_fused_decode_step_runs_no_layer_module_and_a_pinned_number_of_torch_ops() -> None:
    first, every = _count_decode_step("cpu")
    assert sum(first.values()) == 0  # layer 0's module never ran: the native call did every layer
    assert sum(every.values()) == FUSED_STEP_OPS, sorted(every.items())
