"""Torch reference implementations of Qwen3.5's own op contracts (CPU and CUDA, fp32 and bf16): the semantic
definition every kernel of :mod:`ninfer_qwen3_5.ops.triton` is tested against."""
