"""The engine's load-time error, in a module of its own: torch-free, importing nothing.

Where it sits: the model side (``model/``: the tokenizer, which the API process loads without
torch, the config parser, the loaders) and the linear layers' quantization config
(``layers/linear/config.py``) all raise :class:`ModelLoadError`; ``model/errors.py`` and
``model/config.py`` re-export it, so every import names the same class.
"""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model folder that cannot be served: the message names the file (and the field)."""
