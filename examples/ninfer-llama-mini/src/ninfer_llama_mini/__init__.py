"""ninfer-llama-mini: the worked example of docs/plugins.md, a plain pure-attention decoder as a NInfer plugin."""
