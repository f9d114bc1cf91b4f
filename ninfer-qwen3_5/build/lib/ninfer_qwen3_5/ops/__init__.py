"""Qwen3.5's own ops: their contracts (:mod:`.contracts`), torch reference implementations (:mod:`.reference`) and
Triton kernels (:mod:`.triton`), registered by this plugin's ``ninfer_op_contracts`` / ``ninfer_ops`` hooks
(:mod:`.registration`). The generic ops the model also calls (linear, norms, attention, MoE, sampling) are core's.
"""
