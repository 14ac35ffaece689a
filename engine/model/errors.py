"""The error a model folder that cannot be served raises, in a module of its own so it stays torch-free.

Where it sits: the tokenizer (``tokenizer.py``, loaded by the API process, which never
imports torch), the config parser and the weight loader all raise :class:`ModelLoadError`;
``config.py`` re-exports it, so ``kvfleet.engine.model.config.ModelLoadError`` is the same class.
"""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model folder that cannot be served: the message names the file (and the field)."""
