"""The Qwen3.5 builders and pytest fixtures shared by several test packages (imported as ``support.<module>``:
tests/ is on sys.path through the root conftest). Generic helpers (default model, byte tokenizer, random
weights, Programs, profiles, engines) are the installable ``ninfer.testing``."""
