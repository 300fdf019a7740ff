"""Triton kernels for fused gradient accumulation (installed as ``odc_runtime.kernels``)."""
