"""The Qwen4-Exp layers: hyper-connections, PLE, QSA attention, and the Gated DeltaNet with a sigmoid output gate."""
