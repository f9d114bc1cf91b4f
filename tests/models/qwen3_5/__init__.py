"""Qwen3.5 plugin tests (a package so the shared harness imports relatively)."""
