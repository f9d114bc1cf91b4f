"""Pieces several architectures share; ``qwen`` is the Qwen-family Frontend."""
