"""Triton ``gdn_chunk_varlen``: the chunked prefill of several sequences in one call, two launches in all.

The kernels are :mod:`ninfer_qwen3_5.ops.triton.gdn`'s prep and scan kernels with ``VARLEN`` set (read that module's
docstring for the pipeline). Invariants:

- Sequence i is tokens ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` and is chunked from its own first token, so each of
  its chunks computes exactly what ``gdn_chunk_prefill`` computes for it alone: the results are the same bits.
- The call's chunks are numbered sequence after sequence; their count is at most ``ceil(T / 64) + N - 1``, which
  sizes the grid and the scratch from shapes alone. Prep programs past the real count return at once.
- Scan program (value head, Dv tile, sequence i) reads and writes only ``states[slots[i]]``; the slots of non-empty
  sequences are distinct. An empty sequence has no chunk: its program stores the state it loaded, so empty sequences
  may share a slot (a padded call's spare rows). Tokens past ``cu_seqlens[N]`` belong to no chunk and their output
  rows are never written.
- Offsets and slots are read on the device: no host synchronisation, and the launch depends only on T, N and the
  head shapes.
"""

from __future__ import annotations

import torch
import triton
from ninfer.ops.registry import OpImpl

from ninfer_qwen3_5.ops.triton.gdn import (
    _DOT_PRECISION,
    _DOT_PRECISION_16,
    _DTYPES,
    _PREP_KW,
    _SCAN_KW,
    CHUNK,
    _check_heads,
    _gdn_chunk_prep_kernel,
    _gdn_chunk_scan_kernel,
    _interpreting,
    _last_contig,
    _pow2,
)

# In-kernel scratch offsets are int32: Hv x the padded rows x the widest scratch row must stay below 2^31.
_MAX_SCRATCH_ELEMENTS = 1 << 31


def gdn_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, scale: float, *,
                     block_v_scan: int | None = None) -> torch.Tensor:
    """N sequences (rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of ``[T, H, D]`` inputs), each from ``states[slots[i]]``
    ([S, Hv, Dk, Dv] fp32, updated in place)."""
    t_len, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    r = _check_heads(hk, hv)
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("gdn_chunk_varlen: states must be fp32 with a contiguous last dim")
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    nseq = slots.shape[0]
    o = torch.empty((t_len, hv, dv), dtype=q.dtype, device=q.device)
    if t_len == 0 or nseq == 0:
        return o
    bk, bv = _pow2(dk), _pow2(dv)
    if bk > 128 or bv > 128:
        raise ValueError(f"gdn_chunk_varlen (triton): head dims up to 128 supported, got Dk={dk}, Dv={dv}")
    nch = triton.cdiv(t_len, CHUNK) + nseq - 1
    npad = nch * CHUNK
    if hv * npad * max(bk, bv, CHUNK) >= _MAX_SCRATCH_ELEMENTS:
        raise ValueError(f"gdn_chunk_varlen (triton): {t_len} tokens in {nseq} sequences exceed the kernels' int32 "
                         f"scratch offsets; split the call")
    bvs = min(block_v_scan or 16, bv)
    dev, f32 = q.device, torch.float32
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    ids = slots.to(device=dev, dtype=torch.int64)
    w = torch.empty((hv, npad, bk), dtype=f32, device=dev)
    qg = torch.empty((hv, npad, bk), dtype=f32, device=dev)
    kd = torch.empty((hv, npad, bk), dtype=f32, device=dev)
    u = torch.empty((hv, npad, bv), dtype=f32, device=dev)
    aqk = torch.empty((hv, npad, CHUNK), dtype=f32, device=dev)
    gl = torch.empty((hv, nch), dtype=f32, device=dev)
    interp = _interpreting(q)
    prec = _DOT_PRECISION if q.dtype == torch.float32 else _DOT_PRECISION_16
    _gdn_chunk_prep_kernel[(nch, hv)](
        q, k, v, g, beta, w, u, qg, kd, aqk, gl, cu, t_len, npad, nch, nseq, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        R=r, DK=dk, DV=dv, BK=bk, BV=bv, BT=CHUNK, PREC=prec, VARLEN=True, **({} if interp else _PREP_KW))
    _gdn_chunk_scan_kernel[(hv, triton.cdiv(dv, bvs), nseq)](
        w, u, qg, kd, aqk, gl, states, o, cu, ids, t_len, npad, nch, nch,
        states.stride(0), states.stride(1), states.stride(2), o.stride(0), o.stride(1),
        DK=dk, DV=dv, BK=bk, BV=bv, BVS=bvs, BT=CHUNK, PREC=prec, VARLEN=True, **({} if interp else _SCAN_KW))
    return o


OPS = [
    OpImpl(op="gdn_chunk_varlen", name="triton", fn=gdn_chunk_varlen, devices=frozenset({"cuda"}),
           dtypes=_DTYPES, priority=10),
]
