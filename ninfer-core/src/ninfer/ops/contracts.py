"""Op contracts: the named computations that model code calls through an :class:`~ninfer.ops.registry.OpSet`.

Each contract fixes the semantics, argument shapes and in-place effects; implementations
(torch reference in :mod:`ninfer.ops.reference`, Triton on CUDA later) register against the name
through the ``ninfer_ops`` hook. Shapes use: T tokens (flattened over rows), B rows, S state slots,
P pages, page = page_size, Hq/Hkv attention heads, D head dim, Hk/Hv GDN key/value heads,
Dk/Dv GDN head dims, C conv channels, K conv width, E experts, I expert width, V vocab.

Unless stated, outputs have the activation dtype of the inputs and the math is done in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpContract:
    name: str
    signature: str
    semantics: str


@dataclass(frozen=True)
class SharedExpert:
    """An always-on SwiGLU expert added by ``moe_experts`` (Qwen3.5-MoE's shared expert).

    ``projected[T, 2Is]``: x @ [gate; up]^T already computed by the caller (in x.dtype; a row-strided view is
    fine, the last dim must be contiguous): the model fuses this projection with the router's GEMM.
    ``down[H, Is]``: the down projection. ``gate_logit[T]``: the pre-sigmoid scale per token (any float dtype,
    strided allowed). Invariant: ``projected.shape[-1] == 2 * down.shape[-1]``.
    """

    projected: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor


@dataclass(frozen=True)
class GDNDecodeParams:
    """One Gated DeltaNet layer's constants for ``gdn_decode`` (built once per layer; tensors are not copied).

    ``conv_weight[C, K]`` with C = 2 Hk Dk + Hv Dv (channels in q | k | v order); ``neg_a[Hv]`` = -exp(A_log) and
    ``dt_bias[Hv]``, both fp32; ``norm_weight[Dv]`` the output norm's plain weight; ``eps`` its epsilon;
    ``scale`` the query scale (Dk ** -0.5). Invariants: Hv is a multiple of Hk, and conv_weight has C rows.
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


CONTRACTS: dict[str, OpContract] = {c.name: c for c in (
    OpContract("linear", "linear(x[..., in], weight[out, in]) -> [..., out]",
               "x @ weight.T, no bias; accumulates in at least the input precision. A weight dtype other than "
               "x's is promoted (computed in the wider type); the output has x's dtype."),
    OpContract("logits", "logits(x[T, N], weight[V, N]) -> [T, V] fp32",
               "linear(x, weight).float(): the LM head, each logit rounded to x.dtype (as linear rounds it) and "
               "returned in fp32 for sampling; at decode one kernel stores the fp32 values directly."),
    OpContract("greedy_tokens", "greedy_tokens(logits[B, V] float, out[B] int64 = None, host = None) -> tokens[B] int64",
               "Per row the lowest index of the maximum of nan_to_num(logits, nan=-inf) (so +inf/-inf count as "
               "the largest/smallest finite values, NaN as the smallest): exactly torch.argmax of that -- the "
               "Program's all-greedy fast path (equal to ``sample`` at temperature 0 on rows without +-inf). "
               "Written into ``out`` when given (a [B] int64 view, e.g. a decode graph's static token buffer) "
               "and returned. ``host = (ring[R, >=B] int64 CPU, row[1] int64 on the logits' device)``: also stored "
               "into ring[row[0], :B] (row[0] in [0, R): the reference raises otherwise, a kernel stores nothing), "
               "which a decode graph hands to the host without a copy between replays "
               "(an implementation that stores into pinned memory from the device, capturable, marks its "
               "function ``host_capturable = True``; the reference synchronises)."),
    OpContract("rms_norm", "rms_norm(x[..., N], weight[N], eps) -> [..., N]",
               "Zero-centred (Qwen3.5) RMSNorm: fp32 x*rsqrt(mean(x^2)+eps)*(1+w), cast to x.dtype."),
    OpContract("add_rms_norm", "add_rms_norm(x[T, N], residual[T, N], weight[N], eps) -> (y, new_residual)",
               "new_residual = x + residual (in x.dtype); y = rms_norm(new_residual)."),
    OpContract("embed_rms_norm",
               "embed_rms_norm(tokens[T] int64, table[V, N], norm_weight[N], eps) -> (normed[T, N], rows[T, N])",
               "rows = table[tokens] (a gathered copy, in table's dtype); normed = rms_norm(rows, norm_weight, eps): "
               "the embedding lookup and the first block's pre-norm, one launch at decode. Token ids must lie in "
               "[0, V) (the engine checks every id on entry): a kernel may clamp so a bad id cannot fault the "
               "device; the reference raises IndexError on the CPU (torch device-asserts on CUDA)."),
    OpContract("add_rms_norm_linear",
               "add_rms_norm_linear(x[T, N], residual[T, N], norm_weight[N], eps, weight[out, N]) "
               "-> (y[T, out], normed[T, N], new_residual[T, N])",
               "(normed, new_residual) = add_rms_norm(x, residual, norm_weight, eps); y = linear(normed, weight): "
               "a block's pre-norm and its first projection, which at decode may run as one kernel. normed and y "
               "carry the same roundings as the two ops; the norm's reduction order may differ from add_rms_norm's."),
    OpContract("add_rms_norm_swiglu",
               "add_rms_norm_swiglu(x[T, N], residual[T, N], norm_weight[N], eps, gate_up[2I, N]) "
               "-> (act[T, I], normed[T, N], new_residual[T, N])",
               "(y, normed, new_residual) = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up); "
               "act = silu_and_mul(y): a dense MLP's pre-norm, gate/up projection and SwiGLU, which at decode may "
               "run as one kernel without the [T, 2I] intermediate. Same roundings as those ops (y to x.dtype, "
               "then the activation once); the norm's reduction order may differ."),
    OpContract("gated_rms_norm", "gated_rms_norm(x[..., N], gate[..., N], weight[N], eps) -> [..., N]",
               "GDN output norm: n = fp32 rmsnorm(x) cast to x.dtype; n*weight (plain weight, not 1+w); "
               "times silu(gate.float()); cast to x.dtype."),
    OpContract("rope", "rope(x[T, H, D], cos[T, R], sin[T, R]) -> [T, H, D]",
               "NeoX rotate-half on the first R dims (pairs j, j+R/2), dims >= R pass through unchanged."),
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
    OpContract("qk_norm_rope_cache",
               "qk_norm_rope_cache(q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D], q_norm[D], k_norm[D], eps, cos[T, R], "
               "sin[T, R], k_pool, v_pool, slot_mapping[T] int64) -> (q_out[T, Hq, D], k_out[T, Hkv, D])",
               "q_out = rope(rms_norm(q, q_norm, eps), cos, sin), k_out likewise with k_norm, then "
               "kv_cache_write(k_out, v, k_pool, v_pool, slot_mapping): the same values as those three ops (the "
               "norm's reduction order may differ). q, k, v may be row-strided views (last dim contiguous)."),
    OpContract("kv_cache_write",
               "kv_cache_write(k[T, Hkv, D], v[T, Hkv, D], k_pool[P, page, Hkv, D], v_pool[...], "
               "slot_mapping[T] int64) -> None",
               "Stores token t at page slot_mapping[t] // page, offset slot_mapping[t] % page (in place), bit-exact. "
               "Slots are distinct and in [0, P*page); one outside raises (never wraps)."),
    OpContract("paged_attention",
               "paged_attention(q[T, Hq, D], k_pool, v_pool, cu_q[B+1] int32, kv_lens[B] int32, "
               "page_tables[B, maxp] int32, scale) -> o[T, Hq, D]",
               "Causal GQA over paged KV, rows of any query length (prefill over a cached prefix and decode): "
               "query i of row b sits at position kv_lens[b] - q_len_b + i and sees positions <= its own "
               "(q_len_b <= kv_lens[b]; q_len_b = 0 allowed). Query head h reads KV head h // (Hq/Hkv). Softmax "
               "in fp32. Only the first ceil(kv_lens[b]/page) page-table entries and positions < kv_lens[b] "
               "are read."),
    OpContract("paged_decode_attention",
               "paged_decode_attention(q[B, Hq, D], k_pool, v_pool, kv_lens[B] int32, page_tables[B, maxp] int32, "
               "scale, gate[B, Hq*D] = None) -> o[B, Hq, D]",
               "paged_attention with one query per row (the last position). With a gate (the gated attention's "
               "output gate; a row-strided view is fine): o * sigmoid(gate) with torch's roundings -- o and "
               "sigmoid(gate) each rounded to q.dtype, then their product."),
    OpContract("silu_and_mul", "silu_and_mul(x[..., 2I]) -> [..., I]", "silu(x[..., :I]) * x[..., I:]."),
    OpContract("moe_router", "moe_router(logits[T, E], top_k) -> (weights[T, k] fp32, ids[T, k] int64)",
               "softmax over all E in fp32, top-k, renormalised to sum 1 (Qwen3.5 MoE)."),
    OpContract("moe_experts",
               "moe_experts(x[T, H], weights[T, k] fp32, ids[T, k] int64, gate_up[E, 2I, H], down[E, H, I], *, "
               "shared: SharedExpert | None = None) -> [T, H]",
               "sum_j weights[t, j] * down_e(silu(gate_e x) * up_e x) with e = ids[t, j]; gate rows first; plus "
               "sigmoid(shared.gate_logit[t]) * shared.down @ (silu(g) * u) with [g | u] = shared.projected[t] "
               "when a shared expert is given; one fp32 sum, rounded once."),
    OpContract("apply_penalties",
               "apply_penalties(logits[B, V] fp32, output_counts[B, V] int32, prompt_mask[B, V] bool, "
               "repetition[B] fp32, presence[B] fp32, frequency[B] fp32) -> [B, V] fp32",
               "vLLM semantics: tokens seen in prompt or output get logit/r if logit > 0 else logit*r; then "
               "logit -= presence*(count > 0) + frequency*count over output counts. Rows with neutral values "
               "are returned unchanged (bit-exact)."),
    OpContract("sample",
               "sample(logits[B, V] fp32, temperature[B] fp32, top_k[B] int32, top_p[B] fp32, min_p[B] fp32, "
               "seeds[B] int64, steps[B] int64) -> tokens[B] int64",
               "temperature 0: argmax (lowest id on ties). Otherwise logits/T, then top-k (0 = off; keeps "
               "ties with the k-th value), top-p (1 = off; over the top-k survivors' softmax, the shortest "
               "descending prefix whose cumulative prob reaches top_p, plus ties with its last token), min-p "
               "(0 = off; p >= min_p * p_max) filtering, the top token always kept; then Gumbel-max in fp64 "
               "(lowest id on exact ties) with noise -log(-log u) from the counter-based hash of (seed, step, "
               "token id) specified normatively in ninfer.ops.reference.sampling (nested splitmix64): a row's "
               "draw depends only on its own logits, seed and step, never on the batch, and is identical on "
               "CPU and CUDA for identical logits. NaN logits count as -inf."),
    OpContract("token_logprobs",
               "token_logprobs(logits[N, V] float, targets[N] int64) -> (logprob[N] fp32, logsumexp[N] fp32)",
               "Per row: lse = log(sum(exp(logits))) in fp32 and logprob = logits[target] - lse (causal scoring's "
               "reduction, without materialising another [N, V] tensor). Rows are independent; a target outside "
               "[0, V) is an error."),
)}
