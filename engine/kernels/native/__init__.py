"""The native CPU kernels: the C sources in ``csrc/``, built once into one library by ``build.py``, and one
ctypes module per kernel (``paged_decode``, ``paged_prefill``, ``fused_ops``, ``skinny_gemm``, ``packed_gemm``,
``decode_layers``)."""
