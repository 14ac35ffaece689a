"""From ``--model`` to weights in memory: resolve the name, fetch or convert the checkpoint, load it.

Where it sits: ``kvfleet fetch`` and the API process resolve names here (``sources``, torch-free);
the model runner asks :mod:`kvfleet.engine.loader.registry` for the loader its quantization config names.
"""
