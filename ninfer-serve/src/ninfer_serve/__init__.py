"""NInfer HTTP gateway (OpenAI- and Anthropic-compatible) on litestar."""
