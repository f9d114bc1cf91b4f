"""The Qwen4-Exp physical layout: one sequence's StateImage and the paged KV pools.

StateImage fields (fixed size per sequence; the context cache's checkpoints copy them whole):
- per GDN layer, Qwen3.5's two fields (:mod:`ninfer_qwen3_5.state`): the short conv's last K-1 inputs and the
  fp32 delta-rule state;
- per PLE layer ``i``, ``layers/{i}/ple_conv`` ``[nH, (K - 1) * ngram_size]`` in the activation dtype: the last
  inputs of the dilated conv (the normed gated values), oldest first, zeros for a fresh sequence;
- with any PLE layer, ``ngram`` ``[ngram_size - 1]`` int64: the sequence's last ngram_size - 1 token ids, oldest
  first, each stored as ``id + 1`` so that the zeroed initial image (0) reads as "before the sequence", which the
  hash treats as EOS (the n-gram windows of the first tokens are EOS-padded). One field serves every PLE layer (they
  hash the same windows);
- with vision, Qwen3.5's ``rope_delta`` (:mod:`ninfer_qwen3_5.state`): the offset of a decode row's three MRoPE
  axes after the sequence's media.

Paged KV: each indexed-attention layer ``i`` owns a K and a V pool ``[pages, page, Hkv, D]`` (K normed and rotated,
V raw, as Qwen3.5) and a side pool ``layers/{i}/indexer`` of width W = max(d, 2R) and one head: its K row holds the
token's raw indexer key (d values), its V row the cos | sin of the token's rotary angle (R each), which a compressed
block's key is rotated with (the angle of the block's first token). Pages beyond those widths are zero.
"""

from __future__ import annotations

import torch
from ninfer.program.model import KVGeometry, ModelLayout
from ninfer.storage.kv_pool import SidePool
from ninfer.storage.state_image import StateField, StateLayout
from ninfer_qwen3_5.state import state_layout as qwen35_state_layout

from ninfer_qwen4exp.config import Qwen4ExpConfig

NGRAM_FIELD = "ngram"


def ple_conv_field(layer: int) -> str:
    return f"layers/{layer}/ple_conv"


def indexer_pool(layer: int) -> str:
    return f"layers/{layer}/indexer"


def state_layout(cfg: Qwen4ExpConfig, activation_dtype: torch.dtype, *, vision: bool = False) -> StateLayout:
    fields = list(qwen35_state_layout(cfg.qwen35, activation_dtype, vision=vision).fields)
    for i in cfg.ple_layers:
        fields.append(StateField(ple_conv_field(i), (cfg.hc_width, cfg.ple_conv_history), activation_dtype))
    if cfg.ple_layers:
        fields.append(StateField(NGRAM_FIELD, (cfg.ngram_size - 1,), torch.int64))
    return StateLayout(tuple(fields))


def mtp_kv_layer(cfg: Qwen4ExpConfig) -> int:
    """The KV pool id of the MTP layer (:mod:`ninfer_qwen4exp.mtp`): ``num_layers``, never a text layer's index; its
    indexer side pool is ``indexer_pool(mtp_kv_layer(cfg))``."""
    return cfg.num_layers


def kv_geometry(cfg: Qwen4ExpConfig, mtp: bool = False) -> KVGeometry:
    """The text layers' pools; ``mtp``: the MTP layer's K/V and indexer pools too (the same geometry)."""
    layers = tuple(cfg.attention_layers) + ((mtp_kv_layer(cfg),) if mtp else ())
    side = tuple(SidePool(indexer_pool(i), 1, cfg.indexer_width) for i in layers)
    return KVGeometry(layers, cfg.num_kv_heads, cfg.head_dim, side=side)


def model_layout(cfg: Qwen4ExpConfig, dtype: torch.dtype, mtp: bool = False, vision: bool = False) -> ModelLayout:
    return ModelLayout(vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                       kv=kv_geometry(cfg, mtp), state=state_layout(cfg, dtype, vision=vision))
