"""Torch reference Gated DeltaNet (gated delta rule) ops: chunked prefill and single-token decode.

Recurrence per value head j (state S in R^{Dk x Dv}, fp32), with key head j // (Hv / Hk):

    q, k <- x * rsqrt(sum(x^2) + 1e-6)  (fp32, per head);  q <- scale * q
    S <- exp(g_t) S;  delta_t = beta_t (v_t - S^T k_t);  S <- S + k_t delta_t^T;  o_t = S^T q_t

Invariants:
- Inputs q/k/v may be bf16 or fp32; g, beta and the state are fp32; all math is fp32; o has q's dtype.
- The state is read once and overwritten in place with the final S (prefill: ``state``; decode:
  ``states[slots[b]]`` only, other slots untouched; slots distinct within a call).
- ``gdn_chunk_prefill`` computes exactly the recurrence above (up to fp32 rounding) for any T >= 1, by the
  chunked form derived below; it never loops over tokens.

Chunked form (chunk of L tokens starting from state S0; G_t = sum_{s<=t} g_s inside the chunk, so
exp(G_t - G_s) <= 1 for s <= t since g <= 0). Unrolling the recurrence gives
    S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t - G_s} k_s delta_s^T
and substituting into delta_t yields the unit lower-triangular system
    (I + A) Delta = diag(beta) V - diag(beta e^{G}) K S0,   A[t, s] = beta_t e^{G_t - G_s} k_t.k_s  (s < t).
Hence Delta = U - W S0 with U = (I + A)^{-1} diag(beta) V and W = (I + A)^{-1} diag(beta e^{G}) K: U and W
(the UT/WY form) depend only on the chunk's own inputs, so they are solved for all chunks at once. Then
    O = diag(e^{G}) Q S0 + ((Q K^T) * M) Delta,   M[t, s] = e^{G_t - G_s} (s <= t), 0 above the diagonal
    S_L = e^{G_L} S0 + K^T diag(e^{G_L - G}) Delta
is the only sequential part: a scan over chunks carrying S. Decay factors are always formed as exponentials
of differences G_t - G_s (never e^{G_t} * e^{-G_s}) so nothing overflows for strongly decaying gates.
A tail chunk is zero-padded: padded tokens have beta = 0, g = 0 and k = v = q = 0, which contributes nothing
to Delta, O or S.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl

from ninfer_qwen3_5.ops.contracts import GDNDecodeParams
from ninfer_qwen3_5.ops.reference.conv1d import causal_conv1d_update
from ninfer_qwen3_5.ops.reference.gated_norm import gated_rms_norm, gated_rms_norm_sigmoid

CHUNK = 64
# Chunks whose intra-chunk matrices are materialised at once; bounds memory to
# ~Hv * _CHUNKS_PER_GROUP * 64 * 64 * 4 bytes per [L, L] tensor for long prompts.
_CHUNKS_PER_GROUP = 32
_L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + _L2_EPS)


def _expand_key_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hv, D] with value head j reading key head j // (Hv / Hk)."""
    hk = x.shape[-2]
    if hv % hk:
        raise ValueError(f"GDN: value heads {hv} are not a multiple of key heads {hk}")
    return x if hv == hk else x.repeat_interleave(hv // hk, dim=-2)


def gdn_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, scale: float) -> torch.Tensor:
    """Gated delta rule over one sequence ``[T, H, D]`` from ``state[Hv, Dk, Dv]`` (fp32, updated in place)."""
    t_len, hv, dv = v.shape
    qn = _expand_key_heads(_l2norm(q) * scale, hv)
    kn = _expand_key_heads(_l2norm(k), hv)
    n_chunks = -(-t_len // CHUNK)
    pad = n_chunks * CHUNK - t_len

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [T, Hv, ...] fp32 -> [Hv, N, L, ...], zero-padded to whole chunks (see module docstring).
        x = x.float()
        if pad:
            x = torch.cat((x, x.new_zeros((pad,) + x.shape[1:])), dim=0)
        x = x.reshape((n_chunks, CHUNK) + x.shape[1:])
        return x.permute((2, 0, 1) + tuple(range(3, x.dim()))).contiguous()

    qc, kc, vc, gc, bc = chunked(qn), chunked(kn), chunked(v), chunked(g), chunked(beta)
    out = torch.empty((hv, n_chunks, CHUNK, dv), dtype=torch.float32, device=v.device)
    s = state.float().clone()  # [Hv, Dk, Dv]; a copy so a failure midway leaves `state` intact

    device = v.device
    lower_incl = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device).tril()
    lower_strict = lower_incl.tril(-1)
    for c0 in range(0, n_chunks, _CHUNKS_PER_GROUP):
        sl = slice(c0, min(c0 + _CHUNKS_PER_GROUP, n_chunks))
        qg, kg, vg, gg, bg = qc[:, sl], kc[:, sl], vc[:, sl], gc[:, sl], bc[:, sl]
        cum = gg.cumsum(dim=-1)                                   # G_t, [Hv, n, L]
        diff = cum[..., :, None] - cum[..., None, :]              # G_t - G_s
        # Mask above the diagonal before exp: there G_t - G_s >= 0 could overflow, and M must be 0 anyway.
        decay = torch.exp(diff.masked_fill(~lower_incl, float("-inf")))
        kk = kg @ kg.transpose(-1, -2)
        a = (bg[..., :, None] * kk * decay).masked_fill(~lower_strict, 0.0)
        gamma = torch.exp(cum)
        rhs = torch.cat((bg[..., None] * vg, (bg * gamma)[..., None] * kg), dim=-1)
        # unitriangular: the solver takes the implicit unit diagonal of (I + A) and ignores A's zero diagonal.
        uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u, w = uw[..., :dv], uw[..., dv:]
        qk = (qg @ kg.transpose(-1, -2)) * decay
        q_gamma = qg * gamma[..., None]
        k_tail = kg * torch.exp(cum[..., -1:] - cum)[..., None]   # k_s e^{G_L - G_s}
        gamma_last = gamma[..., -1]                               # [Hv, n]
        for i in range(u.shape[1]):
            delta = u[:, i] - w[:, i] @ s                         # [Hv, L, Dv]
            out[:, c0 + i] = q_gamma[:, i] @ s + qk[:, i] @ delta
            s = gamma_last[:, i, None, None] * s + k_tail[:, i].transpose(-1, -2) @ delta
    state.copy_(s)
    o = out.reshape(hv, n_chunks * CHUNK, dv)[:, :t_len].transpose(0, 1)
    return o.to(q.dtype)


def gdn_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """N sequences (rows ``cu_seqlens[i]:cu_seqlens[i + 1]``), each from ``states[slots[i]]`` (updated in place):
    :func:`gdn_chunk_prefill` per sequence (it reads the offsets on the host)."""
    cu, ids = cu_seqlens.tolist(), slots.tolist()
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for i, slot in enumerate(ids):
        a, b = cu[i], cu[i + 1]
        o[a:b] = gdn_chunk_prefill(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[slot], scale)
    return o


def gdn_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, scale: float,
                       out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row ``b`` against ``states[slots[b]]`` ([S, Hv, Dk, Dv] fp32); the new state goes to
    ``states[out_slots[b]]`` (default: ``slots``, in place)."""
    hv = v.shape[1]
    qn = _expand_key_heads(_l2norm(q) * scale, hv)                # [B, Hv, Dk]
    kn = _expand_key_heads(_l2norm(k), hv)
    slots = slots.to(device=states.device, dtype=torch.long)
    s = states.index_select(0, slots).float()                     # [B, Hv, Dk, Dv]
    s = s * torch.exp(g.float())[..., None, None]
    kv_mem = torch.einsum("bhk,bhkv->bhv", kn, s)
    delta = beta.float()[..., None] * (v.float() - kv_mem)
    s = s + kn[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", qn, s)
    out_slots = slots if out_slots is None else out_slots.to(device=states.device, dtype=torch.long)
    states.index_copy_(0, out_slots, s.to(states.dtype))
    return o.to(q.dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` fp32 [T, Hv]: ``neg_a * softplus(a + dt_bias)`` and ``sigmoid(b)``."""
    g = neg_a.float() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNDecodeParams,
               conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The decode tail of a GDN layer, by definition the composition of the four reference ops (contract)."""
    p = params
    n = mixed.shape[0]
    g, beta = gdn_gates(a, b, p.neg_a, p.dt_bias)
    y = causal_conv1d_update(mixed, p.conv_weight, conv_states, slots, out_slots)
    kd = p.key_heads * p.key_dim
    q, k, v = y.split([kd, kd, p.value_heads * p.value_dim], dim=-1)
    o = gdn_recurrent_step(q.reshape(n, p.key_heads, p.key_dim), k.reshape(n, p.key_heads, p.key_dim),
                           v.reshape(n, p.value_heads, p.value_dim), g, beta, states, slots, p.scale, out_slots)
    return (gated_rms_norm_sigmoid if p.sigmoid_gate else gated_rms_norm)(o, z, p.norm_weight, p.eps)


def gdn_verify(mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNDecodeParams,
               conv_states: torch.Tensor, states: torch.Tensor, snap_conv: torch.Tensor, snap_states: torch.Tensor,
               starts: torch.Tensor, counts: torch.Tensor, live_slots: torch.Tensor, snapshots: torch.Tensor,
               out: torch.Tensor) -> None:
    """Successive ``gdn_decode`` steps of each verify row into its snapshots (contract): by definition, one row
    and one step at a time (the counts are read on the host)."""
    for i, (start, count, live) in enumerate(zip(starts.tolist(), counts.tolist(), live_slots.tolist(), strict=True)):
        snaps = snapshots[i].tolist()
        snap_conv[snaps[0]] = conv_states[live]
        snap_states[snaps[0]] = states[live]
        for j in range(count):
            r = slice(start + j, start + j + 1)
            src = torch.tensor([snaps[max(j - 1, 0)]], device=snap_states.device)
            dst = torch.tensor([snaps[j]], device=snap_states.device)
            out[r] = gdn_decode(mixed[r], z[r], a[r], b[r], params, snap_conv, snap_states, src, dst)


OPS = [
    OpImpl(op="gdn_decode", name="torch_reference", fn=gdn_decode, priority=0),
    OpImpl(op="gdn_verify", name="torch_reference", fn=gdn_verify, priority=0),
    OpImpl(op="gdn_gates", name="torch_reference", fn=gdn_gates, priority=0),
    OpImpl(op="gdn_chunk_prefill", name="torch_reference", fn=gdn_chunk_prefill, priority=0),
    OpImpl(op="gdn_chunk_varlen", name="torch_reference", fn=gdn_chunk_varlen, priority=0),
    OpImpl(op="gdn_recurrent_step", name="torch_reference", fn=gdn_recurrent_step, priority=0),
]
