"""The Qwen3.5 StateImage layout: what one sequence's recurrent state holds.

Per GDN layer ``i`` (attention layers have no recurrent state; their history is paged KV):
- ``layers/{i}/conv``: ``[C, K-1]`` in the activation dtype: the last K-1 *inputs* of the short
  conv (C = 2*Hk*Dk + Hv*Dv channels). It stores raw input values, so the activation dtype loses
  nothing and matches what the conv reads.
- ``layers/{i}/recurrent``: ``[Hv, Dk, Dv]`` fp32: the delta-rule state S (HF layout, S^T q = o).

The native initial state is all zeros (HF starts both from zeros), which StateImageStorage provides.
"""

from __future__ import annotations

import torch
from ninfer.storage.state_image import StateField, StateLayout

from ninfer_qwen3_5.config import Qwen35Config


def conv_field(layer: int) -> str:
    return f"layers/{layer}/conv"


def recurrent_field(layer: int) -> str:
    return f"layers/{layer}/recurrent"


def state_layout(cfg: Qwen35Config, activation_dtype: torch.dtype) -> StateLayout:
    fields = []
    for i in cfg.gdn_layers:
        fields.append(StateField(conv_field(i), (cfg.conv_dim, cfg.conv_kernel - 1), activation_dtype))
        fields.append(StateField(recurrent_field(i), (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                      cfg.linear_value_head_dim), torch.float32))
    return StateLayout(tuple(fields))
