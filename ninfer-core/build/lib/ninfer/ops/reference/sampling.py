"""Torch reference sampling ops: ``apply_penalties`` (vLLM semantics) and the batch-invariant ``sample``.

``apply_penalties`` invariants: returns a new tensor (inputs untouched). For a token seen in the prompt or the
output, ``logit / r`` if logit > 0 else ``logit * r``; then ``logit -= presence * (count > 0) + frequency *
count`` over output counts. A row whose three values are neutral (r = 1, presence = frequency = 0) is copied
bit-exactly.

``sample`` invariants, per row b (rows never interact):
- temperature 0: the argmax of the raw logits, lowest id among equal maxima.
- otherwise x = logits / temperature (fp32), then, each step keeping the top token:
  top-k (0 = off): keep x >= the k-th largest x (ties with it are kept);
  top-p (1 = off): over softmax of the top-k survivors sorted descending, keep the shortest prefix whose
  cumulative probability reaches top_p (the token whose exclusive prefix sum is < top_p), plus any token
  tied with the last kept one;
  min-p (0 = off): keep p >= min_p * p_max, i.e. exp(x - max x) >= min_p (the ratio does not depend on
  which other tokens were filtered, so it is taken on x directly).
  The token is argmax over kept ids of (x + G) in fp64, lowest id on exact ties, with Gumbel noise
  G = -log(-log u) and u = u(seed, step, id) from the counter-based hash below. The draw therefore depends
  only on the row's own logits, parameters, seed and step: same (seed, step) -> same token, on CPU and
  CUDA alike (integer hash, identical bits; fp64 logs agree to the last ulp or so).
- NaN logits are treated as -inf (never drawn unless the whole row is NaN/-inf, which returns id 0).

The hash (normative; a kernel must reproduce it bit-exactly). All arithmetic is modulo 2^64, ``>>>`` is a
logical shift, PHI = 0x9E3779B97F4A7C15 and mix64 is the splitmix64 finaliser
    mix64(z) = z ^= z >>> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >>> 27; z *= 0x94D049BB133111EB; z ^ (z >>> 31)
    h = mix64(mix64(mix64(seed + PHI) + (step + 1) * PHI) + (id + 1) * PHI)
    u = ((h >>> 12) + 0.5) / 2^52            (exact in fp64; strictly inside (0, 1): 2^-53 <= u <= 1 - 2^-53)
i.e. splitmix64 streams nested as seed -> step -> token id. torch has only signed int64, whose add/multiply
wrap modulo 2^64 on CPU and CUDA; logical shifts are emulated by masking the sign-extended high bits.
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_PHI = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns: arithmetic shift, then clear the copied sign bits."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[B, V] fp64 in (0, 1) from the normative hash of (seeds[b], steps[b], id)."""
    row = _mix64(_mix64(seeds.to(torch.int64) + _PHI) + (steps.to(torch.int64) + 1) * _PHI)
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device) * _PHI
    h = _mix64(row[:, None] + ids[None, :])
    return (_srl(h, 12).to(torch.float64) + 0.5) * 2.0 ** -52


def _argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """Row argmax returning the lowest index among equal maxima (explicit, not left to the backend)."""
    best = x.max(dim=-1, keepdim=True).values
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == best, ids, x.shape[-1]).min(dim=-1).values.to(torch.int64)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised copy of ``logits[B, V]`` fp32 (see module docstring)."""
    counts = output_counts.to(torch.float32)
    in_output = output_counts > 0
    rep = repetition.float()[:, None]
    seen = prompt_mask | in_output
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - (presence.float()[:, None] * in_output.to(torch.float32) + frequency.float()[:, None] * counts)
    # Neutral rows are selected from the input itself, so they are bit-exact whatever the arithmetic did
    # (e.g. -0.0 or NaN handling inside the expressions above).
    active = (repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)
    return torch.where(active[:, None], out, logits)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, *, sync: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filtering rule of the module docstring: ``(x, keep, greedy_rows)`` with ``x = logits / T`` in fp32
    (NaN -> -inf; T = 1 on greedy rows), ``keep`` the tokens top-k/top-p/min-p leave, ``greedy_rows`` the rows
    with T <= 0. ``sync=True`` skips a filter no row uses (one host check each); ``sync=False`` applies every
    filter to every row (a disabled one keeps everything) with no host synchronisation, for CUDA samplers."""
    vocab = logits.shape[-1]
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    greedy_rows = temperature <= 0
    temp = torch.where(greedy_rows, torch.ones_like(temperature), temperature).float()
    x = logits / temp[:, None]
    keep = torch.ones_like(x, dtype=torch.bool)

    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if not sync or bool(k_on.any()) or bool(p_on.any()):
        sorted_x = x.sort(dim=-1, descending=True).values
        k_eff = torch.where(k_on, top_k.to(torch.int64), vocab)
        kth = sorted_x.gather(1, (k_eff - 1)[:, None])
        keep &= x >= kth  # with top-k off kth is the row minimum: keeps everything
        if not sync or bool(p_on.any()):
            # Probabilities of the top-k survivors, in sorted order (the sort of x is also theirs).
            surv = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
            p_sorted = torch.softmax(surv, dim=-1)
            # Exclusive prefix sum by shifting (not cumsum - p, which rounds differently).
            inclusive = torch.cumsum(p_sorted, dim=-1)
            exclusive = torch.cat((torch.zeros_like(inclusive[:, :1]), inclusive[:, :-1]), dim=-1)
            n_keep = (exclusive < top_p.float()[:, None]).sum(dim=-1).clamp(min=1)
            cutoff = sorted_x.gather(1, (n_keep - 1)[:, None])
            keep &= (x >= cutoff) | ~p_on[:, None]
    m_on = min_p > 0
    if not sync or bool(m_on.any()):
        ratio = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        keep &= (ratio >= min_p.float()[:, None]) | ~m_on[:, None]
    return x, keep, greedy_rows


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token id per row of ``logits[B, V]`` fp32 (see module docstring for the exact rule)."""
    vocab = logits.shape[-1]
    greedy_rows = temperature <= 0
    greedy = _argmax_lowest(torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("inf"),
                                             neginf=float("-inf")))
    if bool(greedy_rows.all()):
        return greedy
    x, keep, greedy_rows = filter_logits(logits, temperature, top_k, top_p, min_p)

    u = hash_uniform(seeds.to(logits.device), steps.to(logits.device), vocab)
    gumbel = -torch.log(-torch.log(u))
    scores = torch.where(keep, x.double() + gumbel, float("-inf"))
    drawn = _argmax_lowest(scores)
    return torch.where(greedy_rows, greedy, drawn)


OPS = [
    OpImpl(op="apply_penalties", name="torch_reference", fn=apply_penalties, priority=0),
    OpImpl(op="sample", name="torch_reference", fn=sample, priority=0),
]
