"""Qwen3.5's MTP (multi-token prediction) head as a speculative drafter: weights (:mod:`.weights`), its KV pool
and call contexts (:mod:`.context`), the head and k-step drafting (:mod:`.head`)."""

from ninfer_qwen3_5.mtp.context import mtp_kv_layer, mtp_step_context
from ninfer_qwen3_5.mtp.head import Draft, DraftRow, MTPOutput, Qwen35MTPHead
from ninfer_qwen3_5.mtp.weights import (
           load_mtp_weights,
           mtp_num_layers,
           mtp_parameter_specs,
           prepare_mtp_weights,
)

__all__ = ["Draft", "DraftRow", "MTPOutput", "Qwen35MTPHead", "load_mtp_weights", "mtp_kv_layer",
           "mtp_num_layers", "mtp_parameter_specs", "mtp_step_context", "prepare_mtp_weights"]
