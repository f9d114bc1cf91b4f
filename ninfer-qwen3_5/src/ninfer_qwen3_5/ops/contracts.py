"""The op contracts only Qwen3.5 models call, registered by this plugin (``ninfer_op_contracts``).

Core defines the architecture-independent ops (:data:`ninfer.ops.contracts.CORE_CONTRACTS`: linear, the unit-offset
RMSNorms, attention, KV cache, RoPE, MoE, sampling); these are the Gated DeltaNet mixer's (gates, short causal conv,
the delta-rule recurrence, its output norm and the fused decode step), the interleaved MRoPE table, the gated
attention's fused zero-centred q/k norm + RoPE + KV write, and the vision tower's (LayerNorm, linear with bias, the
two GELUs, attention within segments). Their reference and Triton implementations live beside
them (:mod:`ninfer_qwen3_5.ops.reference`, :mod:`ninfer_qwen3_5.ops.triton`).

Shapes use: T tokens, B rows, S state slots, Hq/Hkv attention heads, D head dim, Hk/Hv GDN key/value heads, Dk/Dv
GDN head dims, C conv channels, K conv width, R rotary dims. Unless stated, outputs have the activation dtype of the
inputs and the math is done in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ninfer.ops.contracts import OpContract


@dataclass(frozen=True)
class GDNDecodeParams:
    """One Gated DeltaNet layer's constants for ``gdn_decode`` (built once per layer; tensors are not copied).

    ``conv_weight[C, K]`` with C = 2 Hk Dk + Hv Dv (channels in q | k | v order); ``neg_a[Hv]`` = -exp(A_log) and
    ``dt_bias[Hv]``, both fp32; ``norm_weight[Dv]`` the output norm's plain weight; ``eps`` its epsilon;
    ``scale`` the query scale (Dk ** -0.5); ``sigmoid_gate``: the output norm gates with ``sigmoid(fp32 gate)``
    instead of SiLU (``gated_rms_norm``'s cast chain otherwise; Qwen4-Exp's ``output_gate_type: sigmoid``).
    Invariants: Hv is a multiple of Hk, and conv_weight has C rows.
    """

    conv_weight: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    eps: float
    scale: float
    sigmoid_gate: bool = False


CONTRACTS: tuple[OpContract, ...] = (
    OpContract("gated_rms_norm", "gated_rms_norm(x[..., N], gate[..., N], weight[N], eps) -> [..., N]",
               "GDN output norm: n = fp32 rmsnorm(x) cast to x.dtype; n*weight (plain weight, not 1+w); "
               "times silu(gate.float()); cast to x.dtype."),
    OpContract("mrope_cos_sin",
               "mrope_cos_sin(positions[3, T] int64, inv_freq[R/2] fp32, sections tuple|None, interleaved) "
               "-> (cos[T, R], sin[T, R]) fp32",
               "Frequency index i takes its position from axis T/H/W per the MRoPE sections (s_t, s_h, s_w), "
               "sum = R/2. interleaved (Qwen3.5): H if i%3==1 and i<3*s_h, W if i%3==2 and i<3*s_w, else T; "
               "not interleaved: the first s_t indices T, next s_h H, last s_w W. sections=None means plain "
               "RoPE on positions[0] (positions may then be [T]). Angles pos*inv_freq are formed in fp64, "
               "cos/sin rounded once to fp32. cos/sin = cat(f, f)."),
    OpContract("gdn_gates",
               "gdn_gates(a[T, Hv], b[T, Hv], neg_a[Hv] fp32, dt_bias[Hv] fp32) -> (g[T, Hv] fp32, beta[T, Hv] fp32)",
               "GDN per-token gates in fp32: g = neg_a * softplus(a + dt_bias) (torch's softplus: x above 20 "
               "passes through), beta = sigmoid(b). a and b may be row-strided views."),
    OpContract("causal_conv1d_prefill",
               "causal_conv1d_prefill(x[T, C], weight[C, K], conv_state[C, K-1] (in/out)) -> y[T, C]",
               "Depthwise causal conv of one sequence's chunk, prefixed by conv_state (the previous K-1 "
               "inputs, zeros for a fresh sequence), then SiLU. conv_state is overwritten with the last K-1 "
               "inputs of [state | x]."),
    OpContract("causal_conv1d_update",
               "causal_conv1d_update(x[B, C], weight[C, K], conv_states[S, C, K-1] (in/out), slots[B] int64, "
               "out_slots[B] int64 = None) -> y[B, C]",
               "One decode step per row against the state in slot slots[b]; SiLU; the rolled state is written to "
               "slot out_slots[b] (None: slots, in place). Slots are distinct; an out slot is its row's own slot "
               "or one no row of the call reads (lookahead decode writes a spare slot and leaves slots[b] as is)."),
    OpContract("gdn_chunk_prefill",
               "gdn_chunk_prefill(q[T, Hk, Dk], k[T, Hk, Dk], v[T, Hv, Dv], g[T, Hv] fp32, beta[T, Hv] fp32, "
               "state[Hv, Dk, Dv] fp32 (in/out), scale) -> o[T, Hv, Dv]",
               "Gated delta rule over one sequence's chunk starting from state: q,k L2-normalised per head "
               "(eps 1e-6 inside rsqrt(sum x^2 + eps)), q scaled; value head j uses key head j // (Hv/Hk); "
               "S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. state overwritten with the final S."),
    OpContract("causal_conv1d_varlen",
               "causal_conv1d_varlen(x[T, C], weight[C, K], conv_states[S, C, K-1] (in/out), cu_seqlens[N + 1] int32, "
               "slots[N] int64) -> y[T, C]",
               "causal_conv1d_prefill of N sequences in one call: sequence i is rows cu_seqlens[i] .. "
               "cu_seqlens[i + 1] - 1 of x (cu_seqlens starts at 0 and does not decrease), continuing "
               "conv_states[slots[i]], which is updated in place. The slots of non-empty sequences are distinct; an "
               "empty sequence's slot keeps its state and may be shared by other empty sequences only. Other slots "
               "are untouched. Rows past cu_seqlens[N] (a padded call) belong to no sequence: their outputs are "
               "unspecified. The same values as N causal_conv1d_prefill calls. Offsets and slots are read on the "
               "device (no host synchronisation)."),
    OpContract("gdn_chunk_varlen",
               "gdn_chunk_varlen(q[T, Hk, Dk], k[T, Hk, Dk], v[T, Hv, Dv], g[T, Hv] fp32, beta[T, Hv] fp32, "
               "states[S, Hv, Dk, Dv] fp32 (in/out), cu_seqlens[N + 1] int32, slots[N] int64, scale) -> o[T, Hv, Dv]",
               "gdn_chunk_prefill of N sequences in one call (sequences, slots and rows past cu_seqlens[N] as for "
               "causal_conv1d_varlen): sequence i continues states[slots[i]], overwritten with its final state. The "
               "same values as N gdn_chunk_prefill calls (each sequence is chunked from its own first token). Offsets "
               "and slots are read on the device."),
    OpContract("gdn_recurrent_step",
               "gdn_recurrent_step(q[B, Hk, Dk], k[B, Hk, Dk], v[B, Hv, Dv], g[B, Hv], beta[B, Hv], "
               "states[S, Hv, Dk, Dv] fp32 (in/out), slots[B] int64, scale, out_slots[B] int64 = None) "
               "-> o[B, Hv, Dv]",
               "One token of the same recurrence for each row, reading states[slots[b]] and writing the new state "
               "to states[out_slots[b]] (None: slots, in place); out slots as for causal_conv1d_update."),
    OpContract("gdn_decode",
               "gdn_decode(mixed[B, C], z[B, Hv, Dv], a[B, Hv], b[B, Hv], params: GDNDecodeParams, "
               "conv_states[S, C, K-1] (in/out), states[S, Hv, Dk, Dv] fp32 (in/out), slots[B] int64, "
               "out_slots[B] int64 = None) -> o[B, Hv, Dv]",
               "A GDN layer's whole decode step after its input projection, defined as the composition "
               "gdn_gates(a, b) -> causal_conv1d_update(mixed) -> split q | k | v -> gdn_recurrent_step -> "
               "gated_rms_norm(o, z, norm_weight): the same values, intermediates rounded to x.dtype where those "
               "ops round them (the conv output and o). mixed/z/a/b may be row-strided column views of one "
               "projection (last dim contiguous). Slots and out slots as for causal_conv1d_update; both states "
               "of a row go to its out slot."),
    OpContract("gdn_verify",
               "gdn_verify(mixed[N, C], z[N, Hv, Dv], a[N, Hv], b[N, Hv], params: GDNDecodeParams, "
               "conv_states[S, C, K-1], states[S, Hv, Dk, Dv] fp32, snap_conv[S2, C, K-1], snap_states[S2, Hv, Dk, "
               "Dv] fp32, starts[V] int64, counts[V] int64, live_slots[V] int64, snapshots[V, W] int64, "
               "out[N, Hv, Dv]) -> None",
               "Speculative verify of V rows in one call: row i's tokens are rows starts[i] .. starts[i] + "
               "counts[i] - 1 of the inputs (1 <= counts[i] <= W). Defined as counts[i] successive gdn_decode steps "
               "of those rows, the first reading live slot live_slots[i] of (conv_states, states), step j writing "
               "both states after token j to snapshot slot snapshots[i, j] of (snap_conv, snap_states) and its "
               "output to out[starts[i] + j]: the same values. Never writes conv_states, states, other rows of "
               "out or snapshot entries j >= counts[i]. Rows' token ranges and snapshot slots are disjoint."),
    OpContract("layer_norm", "layer_norm(x[..., N], weight[N], bias[N], eps) -> [..., N]",
               "LayerNorm over the last dim in fp32: (x - mean) * rsqrt(var + eps) * weight + bias with the biased "
               "variance, cast once to x.dtype (the vision tower's norms)."),
    OpContract("linear_bias", "linear_bias(x[..., in], weight[out, in], bias[out]) -> [..., out]",
               "x @ weight.T + bias: core's linear with a bias, added before the one rounding to x.dtype (as "
               "torch's addmm does); a weight or bias dtype other than x's is promoted, the output has x's dtype."),
    OpContract("gelu_tanh", "gelu_tanh(x[...]) -> [...]",
               "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in fp32, cast to x.dtype (torch's "
               "gelu(approximate='tanh'))."),
    OpContract("gelu_erf", "gelu_erf(x[...]) -> [...]",
               "The exact GELU 0.5 x (1 + erf(x / sqrt(2))) in fp32, cast to x.dtype."),
    OpContract("segment_attention",
               "segment_attention(q[T, H, D], k[T, H, D], v[T, H, D], cu_seqlens[G + 1] int32, scale) -> o[T, H, D]",
               "Bidirectional (non-causal) attention within G segments: token i of segment g = [cu[g], cu[g+1]) "
               "attends to every token of g and no other, head by head (no GQA). cu_seqlens starts at 0, is "
               "non-decreasing and ends at T (an empty segment is allowed). Scores and softmax in fp32 (a fused "
               "kernel may round the probabilities to q.dtype before multiplying v, as flash attention does), o "
               "rounded to q.dtype."),
    OpContract("qk_norm_rope_cache",
               "qk_norm_rope_cache(q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D], q_norm[D], k_norm[D], eps, cos[T, R], "
               "sin[T, R], k_pool, v_pool, slot_mapping[T] int64) -> (q_out[T, Hq, D], k_out[T, Hkv, D])",
               "q_out = rope(rms_norm_unit_offset(q, q_norm, eps), cos, sin), k_out likewise with k_norm, then "
               "kv_cache_write(k_out, v, k_pool, v_pool, slot_mapping): the same values as those three core ops "
               "(the norm's reduction order may differ). q, k, v may be row-strided views (last dim contiguous)."),
)
