"""NInfer plugin for Qwen3.5 dense and MoE (Gated DeltaNet + gated attention)."""
