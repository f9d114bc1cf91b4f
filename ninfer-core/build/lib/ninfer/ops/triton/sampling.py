"""CUDA ``sample`` and ``apply_penalties`` without host syncs: torch filtering + a fused Triton Gumbel-max.

``sample`` (contract and normative hash: :mod:`ninfer.ops.reference.sampling`):
- Filtering (top-k, top-p, min-p) is the reference's own ``filter_logits`` with ``sync=False``: every row
  goes through the sort-based top-k/top-p and the min-p ratio, a row whose filter is off is exempted with a
  mask instead of skipping the work, so on one device a row's kept set is the reference's exactly. Cost: a
  full per-row sort of the vocabulary on every call, even when no row filters (the price of not syncing;
  the Program skips the sampler for all-greedy steps).
- The draw is one Triton pass over [B, V] split into vocabulary chunks: per token the normative nested
  splitmix64 hash of (seed, step, id) in uint64 arithmetic (wrapping multiply, logical shifts: exactly the
  bits the reference forms with masked int64 ops), ``u = ((h >> 12) + 0.5) * 2^-52`` (exact), fp64
  ``-log(-log u)`` through libdevice's log (CUDA's math library, as torch's fp64 log on CUDA), score
  ``fp64(x) + G`` for kept tokens, and the argmax with the lowest id on ties; the same pass takes the plain
  argmax of x for greedy rows (x equals the raw logits there, temperature being replaced by 1). A second
  tiny kernel merges the chunks in id order (so ties still go to the lowest id).
- Nothing here reads a tensor on the host: the call is CUDA-graph capturable and never waits for the GPU.

``apply_penalties``: one elementwise Triton pass (vLLM rule). The division by the repetition penalty is
correctly rounded (``div_rn``, as torch's); neutral rows are copied bit-exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ninfer.ops.reference.sampling import filter_logits
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, launch_ok

_VOCAB_CHUNK = 4096   # tokens per program of the draw kernel: B * ceil(V / chunk) programs fill the GPU
_BLOCK_V = 1024       # tokens per inner iteration


@triton.jit
def _mix64(z):
    """splitmix64 finaliser on uint64 (logical shifts, multiplies wrap modulo 2^64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _log64(x, INTERP: tl.constexpr):
    """Natural log of fp64: libdevice's __nv_log on the GPU (the CUDA math library routine torch's fp64
    log uses), numpy's under the interpreter, which has no libdevice."""
    if INTERP:
        y = tl.log(x)
    else:
        y = libdevice.log(x)
    return y


@triton.jit(do_not_specialize_on_alignment=["greedy_ptr", "seeds_ptr", "steps_ptr"])
def _draw_chunk_kernel(x_ptr, keep_ptr, greedy_ptr, seeds_ptr, steps_ptr, best_ptr, best_id_ptr, V,
                       stride_x, stride_keep, N_CHUNKS,
                       CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, INTERP: tl.constexpr):
    """Program (row, chunk): best (score, id) of the chunk, lowest id among equal scores.

    Greedy rows score x itself (fp32 widened to fp64: same order, same ties); sampling rows score
    fp64(x) + Gumbel for kept tokens and -inf for filtered ones.
    """
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy = tl.load(greedy_ptr + b) != 0
    seed = tl.load(seeds_ptr + b).to(tl.uint64, bitcast=True)
    step = tl.load(steps_ptr + b).to(tl.uint64, bitcast=True)
    row_key = _mix64(_mix64(seed + 0x9E3779B97F4A7C15) + (step + 1) * 0x9E3779B97F4A7C15)
    best = tl.full([], -float("inf"), tl.float64)
    best_id = chunk * CHUNK  # an all -inf chunk reports its first id, as the reference's argmax would
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, V), BLOCK_V):
        ids = start + tl.arange(0, BLOCK_V)
        mask = ids < V
        x = tl.load(x_ptr + b.to(tl.int64) * stride_x + ids, mask=mask, other=-float("inf")).to(tl.float64)
        keep = tl.load(keep_ptr + b.to(tl.int64) * stride_keep + ids, mask=mask, other=0) != 0
        h = _mix64(row_key + (ids.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
        u = ((h >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2^-52, exact
        gumbel = -_log64(-_log64(u, INTERP), INTERP)
        score = tl.where(greedy, x, tl.where(keep, x + gumbel, -float("inf")))
        score = tl.where(mask, score, -float("inf"))
        blk_best = tl.max(score, 0)
        blk_id = tl.min(tl.where(score == blk_best, ids, 2147483647), 0)
        take = blk_best > best  # strictly greater: an earlier block keeps ties (lower ids)
        best_id = tl.where(take, blk_id, best_id)
        best = tl.where(take, blk_best, best)
    tl.store(best_ptr + b * N_CHUNKS + chunk, best)
    tl.store(best_id_ptr + b * N_CHUNKS + chunk, best_id)


@triton.jit
def _draw_merge_kernel(best_ptr, best_id_ptr, out_ptr, N_CHUNKS, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < N_CHUNKS
    best = tl.load(best_ptr + b * N_CHUNKS + offs, mask=mask, other=-float("inf"))
    ids = tl.load(best_id_ptr + b * N_CHUNKS + offs, mask=mask, other=2147483647)
    top = tl.max(best, 0)
    # Chunks are in id order and each reports its lowest best id, so the smallest id among the chunks
    # reaching the maximum is the row's lowest-id maximum (all -inf rows: chunk 0's first id, 0).
    tl.store(out_ptr + b, tl.min(tl.where((best == top) & mask, ids, 2147483647), 0).to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token id per row of ``logits[B, V]`` fp32 (see the module docstring)."""
    launch_ok(logits)
    bsz, vocab = logits.shape
    dev = logits.device
    out = torch.empty(bsz, dtype=torch.int64, device=dev)
    if bsz == 0:
        return out
    x, keep, greedy = filter_logits(logits, temperature.to(dev), top_k.to(dev), top_p.to(dev), min_p.to(dev),
                                    sync=False)
    n_chunks = triton.cdiv(vocab, _VOCAB_CHUNK)
    best = torch.empty((bsz, n_chunks), dtype=torch.float64, device=dev)
    best_id = torch.empty((bsz, n_chunks), dtype=torch.int32, device=dev)
    _draw_chunk_kernel[(bsz, n_chunks)](
        x, keep.view(torch.uint8), greedy.to(torch.uint8), seeds.to(device=dev, dtype=torch.int64).contiguous(),
        steps.to(device=dev, dtype=torch.int64).contiguous(), best, best_id, vocab, x.stride(0), keep.stride(0),
        n_chunks, CHUNK=_VOCAB_CHUNK, BLOCK_V=_BLOCK_V, INTERP=INTERPRET, num_warps=4)
    _draw_merge_kernel[(bsz,)](best, best_id, out, n_chunks, BLOCK_C=triton.next_power_of_2(n_chunks),
                               num_warps=1)
    return out


@triton.jit
def _penalties_kernel(logits_ptr, counts_ptr, prompt_ptr, rep_ptr, pres_ptr, freq_ptr, out_ptr, V,
                      stride_l, stride_c, stride_p, stride_o, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = ids < V
    row = b.to(tl.int64)
    logit = tl.load(logits_ptr + row * stride_l + ids, mask=mask, other=0.0)
    count = tl.load(counts_ptr + row * stride_c + ids, mask=mask, other=0)
    prompt = tl.load(prompt_ptr + row * stride_p + ids, mask=mask, other=0) != 0
    rep = tl.load(rep_ptr + b)
    pres = tl.load(pres_ptr + b)
    freq = tl.load(freq_ptr + b)
    in_output = count > 0
    seen = prompt | in_output
    scaled = tl.where(logit > 0, tl.math.div_rn(logit, tl.zeros_like(logit) + rep), logit * rep)
    pen = tl.where(seen, scaled, logit)
    pen = pen - (pres * in_output.to(tl.float32) + freq * count.to(tl.float32))
    active = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
    # Neutral rows take the input itself: bit-exact (signed zeros, NaN payloads) whatever the arithmetic did.
    tl.store(out_ptr + row * stride_o + ids, tl.where(active, pen, logit), mask=mask)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised copy of ``logits[B, V]`` fp32 (vLLM semantics; see the reference)."""
    launch_ok(logits)
    bsz, vocab = logits.shape
    dev = logits.device
    out = torch.empty((bsz, vocab), dtype=torch.float32, device=dev)
    if bsz == 0 or vocab == 0:
        return out
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    counts = output_counts.to(device=dev, dtype=torch.int32).contiguous()
    prompt = prompt_mask.to(device=dev, dtype=torch.bool).contiguous().view(torch.uint8)
    block = 2048
    _penalties_kernel[(bsz, triton.cdiv(vocab, block))](
        logits, counts, prompt, repetition.to(device=dev, dtype=torch.float32).contiguous(),
        presence.to(device=dev, dtype=torch.float32).contiguous(),
        frequency.to(device=dev, dtype=torch.float32).contiguous(), out, vocab, logits.stride(0),
        counts.stride(0), prompt.stride(0), out.stride(0), BLOCK_V=block, num_warps=4)
    return out


# Logits are fp32 whatever the model's activation dtype, so these accept any resolved dtype.
OPS = [
    OpImpl(op="sample", name="triton", fn=sample, devices=frozenset({"cuda"}), priority=10),
    OpImpl(op="apply_penalties", name="triton", fn=apply_penalties, devices=frozenset({"cuda"}), priority=10),
]
