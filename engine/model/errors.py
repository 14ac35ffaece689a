"""The error a model folder that cannot be served raises, torch-free.

Where it sits: the tokenizer (``tokenizer/hf.py``, loaded by the API process, which never
imports torch), the config parser and the weight loader all raise :class:`ModelLoadError`, defined in
``engine/errors.py`` (the linear layers' quantization config raises it too) and re-exported here
and by ``config.py``, so ``kvfleet.engine.model.config.ModelLoadError`` is the same class.
"""

from __future__ import annotations

from kvfleet.engine.errors import ModelLoadError

__all__ = ["ModelLoadError"]
