"""Process-wide test set-up that must happen before any test module is imported.

Triton decides, when a function is decorated with ``@triton.jit`` (its own standard library
at ``import triton``, our kernels at ``import kvfleet.engine.kernels``), whether it is
compiled for a GPU or run by the interpreter. Several imports pull triton in early
(``transformers``' Llama model does), so on a machine without CUDA the interpreter is
switched on here, once, before anything imports triton. It stays on for the whole run:
only code that launches triton kernels reads it, and on the CPU those need it. On a machine
with CUDA nothing changes and the kernels are compiled.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
