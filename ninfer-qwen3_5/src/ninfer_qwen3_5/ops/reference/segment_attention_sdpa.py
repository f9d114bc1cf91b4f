"""``segment_attention`` through torch's fused ``scaled_dot_product_attention``, one call per segment: on CUDA in
bf16/fp16 it runs flash (or memory-efficient) attention, the path transformers takes for the same tower, instead of
the reference's fp32 blocks.

Invariants: as the contract says (a token sees exactly its own segment, head by head), with scores and the softmax
accumulated in fp32 inside the fused kernel; the kernel may round the probabilities to q.dtype before multiplying
the values, which the contract allows. The segment bounds are read on the host once. Chosen over the reference on
CUDA for half-precision activations only: in fp32 the reference is the exact path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl

from ninfer_qwen3_5.ops.reference.segment_attention import check_bounds


def segment_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    cu = check_bounds(q, k, v, cu_seqlens)
    out = torch.empty_like(q)
    for a, b in zip(cu, cu[1:], strict=False):
        if a == b:
            continue
        # [1, H, L, D] views of the segment; SDPA wants heads before tokens.
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1)
    return out


OPS = [OpImpl(op="segment_attention", name="torch_sdpa", fn=segment_attention_sdpa, devices=frozenset({"cuda"}),
              dtypes=frozenset({torch.bfloat16, torch.float16}), priority=5)]
