"""The model families, one module each; importing this package registers them all.

Where it sits: the architecture registry (``engine/model/registry.py``) imports it on its first
look-up. A new family is a module here that calls ``register_architecture`` and a line below.
"""

from kvfleet.engine.model.families import gemma3, gpt_oss, llama, moe, qwen3  # noqa: F401  (registered at import)
