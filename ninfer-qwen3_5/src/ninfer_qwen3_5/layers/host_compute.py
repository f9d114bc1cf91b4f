"""The host's share of a MoE layer: the routed experts' fp32 weighted sum, computed by the CPU.

The arithmetic is the reference ``routed_experts_fp32`` (``ninfer.ops.reference.moe``): the (token, expert) pairs
sorted by expert, each expert's two GEMMs in the wider of the activation and weight dtypes, the SwiGLU in fp32
rounded to that dtype before the down projection, the pairs' weighted outputs summed in fp32 in that order. Only
the number of CPU operations differs: the reference runs nine small ops an expert; here every expert costs its two
GEMMs (their rows joined by one concatenation) and the rest runs once over all pairs, and a decode step's few pairs
are sorted by expert in Python lists. On a many-core host each op wakes the whole intra-op thread team, which at
a decode step's one token an expert costs more than the elementwise work itself.

Invariant: on the CPU the result is bitwise the reference's (same operations on the same rows, the same summation
order), checked by ``tests/engine/test_host_experts.py``.

``EngineOptions.host_expert_kernel="compiled"`` (:func:`compiled_rows`) instead computes every pair's expert output
in one ``torch.compile``-generated CPU kernel, gathering each pair's expert weights inside its reductions: one
parallel region for all of a call's experts instead of two GEMMs an expert. The same roundings (the projections'
outputs and the SwiGLU to the activation dtype); the fp32 sums in the kernel's order, so equal to the reference
within accumulation-order tolerance, not bitwise. ``host_expert_kernel="native"``
(:class:`~ninfer_qwen3_5.layers.host_native.NativeRows`) is NInfer's own C kernel: each expert read once for all
of its tokens, quantized banks (q4, q8) read as stored; the same tolerance. A dense bank's call with many tokens
an expert (a prefill chunk's, :data:`NATIVE_DENSE_TOKENS`) goes to torch's GEMMs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.errors import NotSupportedError
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.quant import PackedWeight

from ninfer_qwen3_5.layers import host_native
from ninfer_qwen3_5.layers.host_native import NativeRows

#: A dense bank goes to the native kernel while a call's routed experts average at most this many tokens (a decode
#: step's): above that torch's GEMMs use each expert's weights better than the kernel's tiles of four tokens. A
#: quantized bank always does (torch's path decodes each expert to fp32 first, which costs more than either).
NATIVE_DENSE_TOKENS = 4

#: Up to this many routed pairs (a decode step's), the pairs are sorted by expert in Python lists: at that size a
#: handful of list operations costs less than the tensor operations that sort large prefill chunks.
SMALL_PAIRS = 128


def expert_groups(ids: torch.Tensor, skip: torch.Tensor | None,
                  experts: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The pairs of ``ids[T, k]`` not skipped, stably sorted by expert: (their flat pair indices, int64, and
    ``(expert, count)`` for each routed expert in ascending order). The host sum and the copy path's choice both
    count through it."""
    flat = ids.reshape(-1)
    if flat.numel() <= SMALL_PAIRS:
        experts_of = flat.tolist()
        kept = range(len(experts_of)) if skip is None else [p for p, s in enumerate(skip.reshape(-1).tolist()) if not s]
        order = sorted(kept, key=experts_of.__getitem__)   # stable, as the tensor path's argsort
        groups: list[tuple[int, int]] = []
        for p in order:
            e = experts_of[p]
            if groups and groups[-1][0] == e:
                groups[-1] = (e, groups[-1][1] + 1)
            else:
                groups.append((e, 1))
        return torch.tensor(order, dtype=torch.int64), groups
    if skip is not None:   # a skipped pair goes to bucket E, after every expert's group
        flat = torch.where(skip.reshape(-1), experts, flat)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)[:experts]
    active = torch.nonzero(counts).flatten()
    groups = list(zip(active.tolist(), counts[active].tolist(), strict=True))
    return order[:sum(c for _, c in groups)], groups


def _expert_rows(xs: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Pair ``p``'s expert output ``down_e(silu(g) * u)`` for ``e = experts[p]``, ``x = xs[p]``, in fp32 ``[n, H]``
    after the reference's roundings to ``xs.dtype``; the weights are read through ``experts`` (never gathered)."""
    inter = down.shape[-1]
    h = (gate_up[experts].float() * xs[:, None, :].float()).sum(-1).to(xs.dtype).float()
    act = (F.silu(h[:, :inter]) * h[:, inter:]).to(xs.dtype)
    return (down[experts].float() * act[:, None, :].float()).sum(-1).to(xs.dtype).float()


def compiled_rows(hidden: int, inter: int, dtype: torch.dtype, threads: int | None = None):
    """The compiled pair kernel (module docstring), compiled now for experts of ``hidden`` x ``inter`` in ``dtype``
    with ``threads`` intra-op threads (None: torch's current count), the count its parallel regions keep (one
    compile serves every pair count from 2 on: :func:`routed_sum` pads a single pair). A host without
    torch.compile's C++ toolchain gets a NotSupportedError naming the option."""
    rows = torch.compile(_expert_rows, dynamic=True)
    gate_up, down = torch.zeros((2, 2 * inter, hidden), dtype=dtype), torch.zeros((2, hidden, inter), dtype=dtype)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        rows(torch.zeros((2, hidden), dtype=dtype), torch.tensor([0, 1]), gate_up, down)
    except Exception as exc:   # noqa: BLE001 (whatever the compiler stack raises)
        raise NotSupportedError(f"host_expert_kernel='compiled' (--host-expert-kernel compiled): torch.compile could "
                                f"not build the host-expert kernel on this host ({type(exc).__name__}: "
                                f"{str(exc)[:300]}); use the default 'torch' kernel") from None
    finally:
        torch.set_num_threads(before)
    return rows


def routed_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down,
               skip: torch.Tensor | None = None, rows=None) -> torch.Tensor:
    """``routed_experts_fp32(x, weights, ids, gate_up, down, skip)``: the fp32 ``[T, H]`` sum on x's device, for
    banks that are tensors ``[E, ...]`` or anything indexable by expert with ``shape`` and ``dtype`` (a quantized
    bank decoded per expert); ``skip`` (bool ``[T, k]``): pairs left out (computed elsewhere). With ``rows``
    (:func:`compiled_rows` and tensor banks, or a :class:`NativeRows` and banks it reads), the pairs' expert
    outputs come from that kernel."""
    t_len, k = ids.shape
    inter, hidden = down.shape[-1], x.shape[-1]
    out = torch.zeros((t_len, hidden), dtype=torch.float32, device=x.device)
    wide = torch.promote_types(x.dtype, gate_up.dtype)
    native = isinstance(rows, NativeRows)
    stored = [b.bank if isinstance(b, DecodedBank) else b for b in (gate_up, down)] if native else None
    if (native and ids.numel() <= min(SMALL_PAIRS, host_native.CHUNK_PAIRS) and rows.supports(*stored)
            and x.dtype in (torch.float32, torch.bfloat16)
            # At most NATIVE_DENSE_TOKENS tokens, no expert has more: the rule below holds without counting.
            and (t_len <= NATIVE_DENSE_TOKENS or isinstance(stored[0], PackedWeight))):
        return rows.add_routed_ids(out, x, weights, ids, skip, *stored, wide)   # a decode step's call: sorted in C
    order, groups = expert_groups(ids, skip, gate_up.shape[0])
    if not groups:
        return out
    tokens = order // k
    xs = x.index_select(0, tokens).to(wide)
    if native:   # the banks read as stored
        few = len(order) <= NATIVE_DENSE_TOKENS * len(groups)
        if rows.supports(*stored) and (few or isinstance(stored[0], PackedWeight)):
            return rows.add_routed(out, xs, tokens, weights.reshape(-1)[order], groups, *stored, wide)
    elif rows is not None and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        experts = ids.reshape(-1)[order]
        single = experts.numel() == 1   # a size-1 dimension would compile a second kernel: pad it
        # The kernel reads the banks as stored (in fp32) and rounds to the activation dtype ``wide``, as xs is.
        y = rows(xs.repeat(2, 1) if single else xs, experts.repeat(2) if single else experts, gate_up, down)
        out.index_add_(0, tokens, y[:1] * weights.reshape(-1)[order].float()[:, None] if single
                       else y * weights.reshape(-1)[order].float()[:, None])
        return out
    spans = []   # (expert, first row, end row) in the sorted pairs
    for expert, count in groups:
        start = spans[-1][2] if spans else 0
        spans.append((expert, start, start + count))
    h = torch.cat([xs[a:b] @ gate_up[e].to(wide).t() for e, a, b in spans]).float()
    act = (F.silu(h[:, :inter]) * h[:, inter:]).to(wide)
    y = torch.cat([act[a:b] @ down[e].to(wide).t() for e, a, b in spans])
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order].float()[:, None])
    return out
