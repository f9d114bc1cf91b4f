"""NInfer plugin for Qwen4-Exp (docs/architectures/qwen4exp.md)."""
