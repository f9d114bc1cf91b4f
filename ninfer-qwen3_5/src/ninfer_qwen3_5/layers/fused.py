"""Row-stacked projections: several weights that read the same input run as one GEMM when their rows are
already adjacent in memory; and a block's pre-norm formed by its first projection (:class:`NormInput`).

The converter stores GDN ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` as one parent object
(see :mod:`ninfer_qwen3_5.mapping`; older artifacts: qkv+z and b+a as two); the loader hands each binding out as a zero-copy view of its
parent. :func:`row_groups` finds such runs and returns one ``[sum rows, in]`` view per run -- no copy, no extra
memory -- so a decode step launches one GEMV per run instead of one per binding. Weights that are not adjacent
(another dtype after a cast, a differently converted artifact) simply form runs of one: the result is the same.
Quantized weights (:class:`~ninfer.quant.PackedWeight`) of one format whose row blocks are adjacent in every
plane (row blocks of one stored parent) form runs the same way: the run is one packed weight whose planes are
views over the rows of all of them; the ops take it by its stored format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ninfer.quant import PackedWeight


@dataclass(frozen=True)
class RowGroup:
    """``weight[sum(sizes), in]``: the rows of consecutive projections, in order."""

    weight: torch.Tensor | PackedWeight
    sizes: tuple[int, ...]


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b``'s rows start where ``a``'s end, in one storage, both row-contiguous with the same row width."""
    if a.numel() == 0 and b.numel() == 0:   # a plane the format does not have (q4/q8 high bits)
        return a.shape[1:] == b.shape[1:]
    return (a.shape[1:] == b.shape[1:] and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and (a.shape[0] == 0 or a.data_ptr() + a.shape[0] * a.stride(0) * a.element_size() == b.data_ptr()))


def _adjacent(a, b) -> bool:
    if isinstance(a, PackedWeight) or isinstance(b, PackedWeight):
        return (isinstance(a, PackedWeight) and isinstance(b, PackedWeight) and a.format == b.format
                and a.activations == b.activations
                and len(a.shape) == len(b.shape) == 2 and a.shape[1] == b.shape[1]
                and all(_follows(p, q) for p, q in zip(a.planes, b.planes, strict=True)))
    return (a.dim() == b.dim() == 2 and a.dtype == b.dtype and a.device == b.device
            and a.shape[1] == b.shape[1] and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def row_groups(weights: Sequence[torch.Tensor]) -> list[RowGroup]:
    """Maximal runs of row-adjacent weights, in input order, each as one view (never a copy)."""
    groups: list[list[torch.Tensor]] = []
    for w in weights:
        if groups and _adjacent(groups[-1][-1], w):
            groups[-1].append(w)
        else:
            groups.append([w])
    out = []
    for run in groups:
        rows = sum(w.shape[0] for w in run)
        head = run[0]
        if len(run) == 1:
            view = head
        elif isinstance(head, PackedWeight):
            view = PackedWeight(head.format, (rows, head.shape[1]), tuple(
                p.as_strided((rows, *p.shape[1:]), p.stride()) for p in head.planes), head.activations)
        else:
            view = head.as_strided((rows, head.shape[1]), (head.shape[1], 1))
        out.append(RowGroup(view, tuple(w.shape[0] for w in run)))
    return out


def project(ops, h: torch.Tensor, groups: Sequence[RowGroup]) -> list[torch.Tensor]:
    """``[h @ w.T for w in the original weights]``, as column views of one output per group."""
    outs: list[torch.Tensor] = []
    for g in groups:
        y = ops.linear(h, g.weight)
        outs.extend(y.split(g.sizes, dim=-1) if len(g.sizes) > 1 else (y,))
    return outs


@dataclass(frozen=True)
class NormInput:
    """A block's input before its pre-norm: ``h = rms_norm_unit_offset(x + residual)`` (``x`` None:
    ``rms_norm_unit_offset(residual)``, the first layer, whose h the model may have formed already with the
    embedding: ``normed``). The block forms h with its first projection (:func:`norm_project`, one
    ``add_rms_norm_unit_offset_linear``), so at decode the norm is no launch of its own. Blocks return
    ``(out, residual)`` with the new residual stream, which the next block's NormInput adds ``out`` to.
    Invariant: ``normed`` is given only with ``x`` None, and equals
    ``rms_norm_unit_offset(residual, weight, eps)``, or ``weight`` is None (:meth:`formed`)."""

    x: torch.Tensor | None
    residual: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    normed: torch.Tensor | None = None

    @classmethod
    def formed(cls, h: torch.Tensor) -> NormInput:
        """A block input formed by the caller (an architecture whose blocks read no pre-norm residual stream, such
        as hyper-connections): the block projects ``h`` as is and returns ``h`` as its "residual"."""
        return cls(None, h, None, 0.0, h)


def norm_project(ops, inp: NormInput, groups: Sequence[RowGroup]
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(project(ops, h, groups), h, new residual)`` for ``h`` the block's normed input."""
    if inp.x is None:
        h = inp.normed if inp.normed is not None else ops.rms_norm_unit_offset(inp.residual, inp.weight, inp.eps)
        return project(ops, h, groups), h, inp.residual
    first, rest = groups[0], groups[1:]
    y, h, residual = ops.add_rms_norm_unit_offset_linear(inp.x, inp.residual, inp.weight, inp.eps, first.weight)
    outs = list(y.split(first.sizes, dim=-1)) if len(first.sizes) > 1 else [y]
    return outs + project(ops, h, rest), h, residual
