"""``ModelConfig`` is a torch-free leaf beside ``EngineConfig`` (issue #44): importing it, parsing a
checkpoint's config.json and sizing its KV cache load no torch, so the API process, ``kvfleet plan``
and the simulator can read a model's shape without paying torch's import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
from pathlib import Path
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.rope_scaling import rope_context_len
config = ModelConfig.from_file(Path(sys.argv[1]))
print(json.dumps({"torch": "torch" in sys.modules, "max_model_len": config.max_model_len,
                  "context": rope_context_len(config), "layers": config.num_layers}))
"""


def _probe(config: dict[str, object], tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],  # the checkout under test, not an installed copy
    )
    return json.loads(out.stdout)


# A Qwen2 checkpoint's config.json, its rope stretched fourfold by yarn.
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
}


def test_parsing_a_checkpoint_config_with_yarn_rope_imports_no_torch(tmp_path: Path) -> None:
    seen = _probe(CONFIG, tmp_path)
    assert seen == {"torch": False, "max_model_len": 16384, "context": 16384, "layers": 3}


def test_kv_bytes_per_token_still_takes_a_torch_dtype() -> None:
    import torch

    from kvfleet.engine.model.config import ModelConfig

    config = ModelConfig.from_dict(CONFIG)  # head_dim 64 / 4 heads = 16
    # K and V, per layer, per KV head, per head dim: 2 * 3 * 2 * 16 elements
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 3 * 2 * 16 * 2
    assert config.kv_bytes_per_token(torch.float32) == 2 * 3 * 2 * 16 * 4
