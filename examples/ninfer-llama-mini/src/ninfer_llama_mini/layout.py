"""The physical layout the Program declares, shared with the profile so the two cannot disagree.

KV: one K and one V pool per layer (every layer attends over the whole history), each
``[num_pages, page_size, num_kv_heads, head_dim]`` in the run dtype. State: none. A pure-attention model has
no per-sequence recurrent state, its whole history is its KV pages, so the StateImage layout has no fields.
The StateImage slots still exist (one per sequence; the engine addresses sequences by slot), and each holds
one alignment unit of bytes (``StateLayout.image_bytes``) that nothing reads or writes.
"""

from __future__ import annotations

from ninfer.program.model import KVGeometry, ModelLayout
from ninfer.storage.state_image import StateLayout

from ninfer_llama_mini.config import LlamaMiniConfig

STATE_LAYOUT = StateLayout(fields=())


def model_layout(cfg: LlamaMiniConfig) -> ModelLayout:
    return ModelLayout(vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                       kv=KVGeometry(tuple(range(cfg.num_layers)), cfg.num_kv_heads, cfg.head_dim),
                       state=STATE_LAYOUT)
