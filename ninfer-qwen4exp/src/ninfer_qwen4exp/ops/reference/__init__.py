"""Torch reference implementations of Qwen4-Exp's op contracts (CPU and CUDA, fp32 and bf16): the semantic definition
a kernel of these ops is tested against."""
