"""The engine-core process: the ``Engine`` step loop, the core loop that serves it, and the link to the API side.

Where it sits: between the API process (``engine/client/``) and the model runner (``engine/runner/``);
nothing here imports torch (import-linter contracts in pyproject.toml).
"""
