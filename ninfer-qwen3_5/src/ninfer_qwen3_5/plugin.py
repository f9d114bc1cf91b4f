"""Entry point ``qwen3_5`` (group ``ninfer``): registers the Qwen3.5 architectures and source mappings."""
