"""Test-model builders: the embedded ``tiny`` Llama as a Hugging Face folder and as a GGUF file.

Where it sits: ``--model tiny`` resolves to :mod:`kvfleet.engine.testing.tiny` (``loader/sources.py``);
the tests and benchmarks build checkpoints with it; torch-free.
"""
