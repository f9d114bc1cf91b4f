"""Qwen3.5 decoder building blocks; every computation goes through the OpSet."""
