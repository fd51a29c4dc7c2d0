"""Fused Triton kernels of the CUDA fast path (the torch modules in rlt_worker.models stay the reference)."""
