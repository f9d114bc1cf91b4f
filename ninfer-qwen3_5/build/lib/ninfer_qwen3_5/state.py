"""The Qwen3.5 StateImage layout: what one sequence's recurrent state holds.

Per GDN layer ``i`` (attention layers have no recurrent state; their history is paged KV):
- ``layers/{i}/conv``: ``[C, K-1]`` in the activation dtype: the last K-1 *inputs* of the short
  conv (C = 2*Hk*Dk + Hv*Dv channels). It stores raw input values, so the activation dtype loses
  nothing and matches what the conv reads.
- ``layers/{i}/recurrent``: ``[Hv, Dk, Dv]`` fp32: the delta-rule state S (HF layout, S^T q = o).

With vision (``vision=True``), one more field:
- ``rope_delta``: ``[1]`` int64: the sequence's MRoPE delta (its decode tokens sit at ``index + delta`` on all
  three axes, :mod:`ninfer_qwen3_5.vision.positions`), set when the sequence opens. As part of the image it
  follows the state wherever it goes: a lookahead step's spare slot, a checkpoint, the Host tier.

The native initial state is all zeros (HF starts both from zeros; a text sequence's delta is 0), which
StateImageStorage provides.
"""

from __future__ import annotations

import torch
from ninfer.storage.state_image import StateField, StateLayout

from ninfer_qwen3_5.config import Qwen35Config


def conv_field(layer: int) -> str:
    return f"layers/{layer}/conv"


def recurrent_field(layer: int) -> str:
    return f"layers/{layer}/recurrent"


ROPE_DELTA = "rope_delta"


def state_layout(cfg: Qwen35Config, activation_dtype: torch.dtype, *, vision: bool = False) -> StateLayout:
    fields = []
    for i in cfg.gdn_layers:
        fields.append(StateField(conv_field(i), (cfg.conv_dim, cfg.conv_kernel - 1), activation_dtype))
        fields.append(StateField(recurrent_field(i), (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                      cfg.linear_value_head_dim), torch.float32))
    if vision:
        fields.append(StateField(ROPE_DELTA, (1,), torch.int64))
    return StateLayout(tuple(fields))
