"""Op contracts: the named computations that model code calls through an :class:`~ninfer.ops.registry.OpSet`.

A contract fixes an op's semantics, argument shapes and in-place effects; implementations (torch reference
in :mod:`ninfer.ops.reference`, Triton kernels in :mod:`ninfer.ops.triton`) target it by name through the
``ninfer_ops`` hook. Contracts themselves are registered through the ``ninfer_op_contracts`` hook: core
registers the architecture-independent ones below (:data:`CORE_CONTRACTS`, from its default plugin
``reference_ops``); an architecture plugin registers the ops only its models call (their contracts, kernels
and tests live in that plugin). A name says what the op computes, so a variant with other arithmetic is another
contract, never a flag hidden in an implementation.

Shapes use: T tokens (flattened over rows), B rows, P pages, page = page_size, Hq/Hkv attention heads, D head
dim, E experts, I expert width, H hidden size, V vocab. Unless stated, outputs have the activation dtype of the
inputs and the math is done in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpContract:
    """One op: ``name`` (the OpSet attribute model code calls), ``signature`` (arguments with shapes and
    dtypes) and ``semantics`` (the normative definition every implementation is tested against).
    Invariant: a name is registered by exactly one plugin (the registry rejects a second)."""

    name: str
    signature: str
    semantics: str


@dataclass(frozen=True)
class SharedExpert:
    """An always-on SwiGLU expert scaled per token by a sigmoid gate, added by ``moe_experts``.

    ``projected[T, 2Is]``: x @ [gate; up]^T already computed by the caller (in x.dtype; a row-strided view is
    fine, the last dim must be contiguous): a model may fuse this projection with the router's GEMM.
    ``down[H, Is]``: the down projection. ``gate_logit[T]``: the pre-sigmoid scale per token (any float dtype,
    strided allowed). Invariant: ``projected.shape[-1] == 2 * down.shape[-1]``.
    """

    projected: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor


CORE_CONTRACTS: tuple[OpContract, ...] = (
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
    OpContract("rms_norm_unit_offset", "rms_norm_unit_offset(x[..., N], weight[N], eps) -> [..., N]",
               "RMSNorm whose weight stores the scale's offset from 1 (a zero weight is the identity scale): "
               "fp32 x*rsqrt(mean(x^2)+eps)*(1+w), cast to x.dtype."),
    OpContract("add_rms_norm_unit_offset",
               "add_rms_norm_unit_offset(x[T, N], residual[T, N], weight[N], eps) -> (y, new_residual)",
               "new_residual = x + residual (in x.dtype); y = rms_norm_unit_offset(new_residual)."),
    OpContract("embed_rms_norm_unit_offset",
               "embed_rms_norm_unit_offset(tokens[T] int64, table[V, N], norm_weight[N], eps) "
               "-> (normed[T, N], rows[T, N])",
               "rows = table[tokens] (a gathered copy, in table's dtype); normed = rms_norm_unit_offset(rows, "
               "norm_weight, eps): the embedding lookup and the first block's pre-norm, one launch at decode. Token "
               "ids must lie in [0, V) (the engine checks every id on entry): a kernel may clamp so a bad id cannot "
               "fault the device; the reference raises IndexError on the CPU (torch device-asserts on CUDA). "
               "The table may be in page-locked host memory while tokens are on a GPU (a placement that keeps "
               "the table off the device): both results are on the tokens' device, the rows read over the bus."),
    OpContract("add_rms_norm_unit_offset_linear",
               "add_rms_norm_unit_offset_linear(x[T, N], residual[T, N], norm_weight[N], eps, weight[out, N]) "
               "-> (y[T, out], normed[T, N], new_residual[T, N])",
               "(normed, new_residual) = add_rms_norm_unit_offset(x, residual, norm_weight, eps); y = linear(normed, "
               "weight): a block's pre-norm and its first projection, which at decode may run as one kernel. normed "
               "and y carry the same roundings as the two ops; the norm's reduction order may differ from "
               "add_rms_norm_unit_offset's."),
    OpContract("add_rms_norm_unit_offset_swiglu",
               "add_rms_norm_unit_offset_swiglu(x[T, N], residual[T, N], norm_weight[N], eps, gate_up[2I, N]) "
               "-> (act[T, I], normed[T, N], new_residual[T, N])",
               "(y, normed, new_residual) = add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, gate_up); "
               "act = silu_and_mul(y): a dense MLP's pre-norm, gate/up projection and SwiGLU, which at decode may "
               "run as one kernel without the [T, 2I] intermediate. Same roundings as those ops (y to x.dtype, "
               "then the activation once); the norm's reduction order may differ."),
    OpContract("rope", "rope(x[T, H, D], cos[T, R], sin[T, R]) -> [T, H, D]",
               "NeoX rotate-half on the first R dims (pairs j, j+R/2), dims >= R pass through unchanged."),
    OpContract("kv_cache_write",
               "kv_cache_write(k[T, Hkv, D], v[T, Hkv, D], k_pool[P, page, Hkv, D], v_pool[...], "
               "slot_mapping[T] int64) -> None",
               "Stores token t at page slot_mapping[t] // page, offset slot_mapping[t] % page (in place), bit-exact. "
               "Slots are distinct and in [0, P*page); one outside raises when slot_mapping is on the host, and is dropped "
               "(never wraps, never a host sync) when it is on the device."),
    OpContract("paged_attention",
               "paged_attention(q[T, Hq, D], k_pool, v_pool, cu_q[B+1] int32, kv_lens[B] int32, "
               "page_tables[B, maxp] int32, scale, gate[T, Hq*D] = None) -> o[T, Hq, D]",
               "Causal GQA over paged KV, rows of any query length (prefill over a cached prefix and decode): "
               "query i of row b sits at position kv_lens[b] - q_len_b + i and sees positions <= its own "
               "(q_len_b <= kv_lens[b]; q_len_b = 0 allowed). Query head h reads KV head h // (Hq/Hkv). Softmax "
               "in fp32. Only the first ceil(kv_lens[b]/page) page-table entries and positions < kv_lens[b] "
               "are read. With a gate: o * sigmoid(gate) as paged_decode_attention applies it."),
    OpContract("paged_decode_attention",
               "paged_decode_attention(q[B, Hq, D], k_pool, v_pool, kv_lens[B] int32, page_tables[B, maxp] int32, "
               "scale, gate[B, Hq*D] = None) -> o[B, Hq, D]",
               "paged_attention with one query per row (the last position). With a gate (an output-gated "
               "attention's gate; a row-strided view is fine): o * sigmoid(gate) with torch's roundings -- o and "
               "sigmoid(gate) each rounded to q.dtype, then their product."),
    OpContract("silu_and_mul", "silu_and_mul(x[..., 2I]) -> [..., I]", "silu(x[..., :I]) * x[..., I:]."),
    OpContract("moe_router", "moe_router(logits[T, E], top_k) -> (weights[T, k] fp32, ids[T, k] int64)",
               "The softmax top-k router: softmax over all E in fp32, the top_k largest probabilities (descending), "
               "renormalised to sum 1 (unconditionally). Other routing rules (sigmoid scores, biased selection, "
               "no renormalisation) are other contracts."),
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
)
