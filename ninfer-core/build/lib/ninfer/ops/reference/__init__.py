"""Torch reference ops (CPU and CUDA, fp32 and bf16): the semantic definition every kernel is tested against."""
