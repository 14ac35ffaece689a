"""The Triton kernels of the CUDA path (``kv_store``, ``paged_attention``, ``fused_ops``, ``lora``); on a CPU
they run under Triton's interpreter in the tests only."""
