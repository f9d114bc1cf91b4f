"""The weight-reading dense ops for packed quantized weights on Triton (``linear``, ``logits``,
``add_rms_norm_unit_offset_linear``, ``add_rms_norm_unit_offset_swiglu``), registered per stored format
(:attr:`~ninfer.ops.registry.OpImpl.weight_formats`): every groupwise format (q4/q5/q6/q8), fp8 row and nvfp4
(whose own GEMV and GEMM are in :mod:`~ninfer.ops.triton.quant_nvfp4`; the fused norm/SwiGLU variants run the
Triton norm, the product and ``silu_and_mul`` in sequence for it).

Same contracts as :mod:`ninfer.ops.reference.quantized` (the dense op with the weight replaced by its decoded
values, fp32 accumulation, the output rounded to x's dtype). Activations stay in x's dtype (A16), except for
a weight marked ``activations="a8"`` (fp8 row, every use ``AllowA8``) in a call of more than MAX_ROWS rows
(prefill): that runs the A8 fp8 GEMM (:func:`~ninfer.ops.triton.quant_gemm.gemm_a8`, activations quantized to
E4M3 per token, as :mod:`ninfer.ops.reference.a8` defines it) on the FP8 tensor cores. Decode rows keep the A16
GEMV: it reads the same weight bytes, and quantizing the activations would only add a pass (AllowA8 permits
8-bit activations, it does not require them). The reference runs A8 for every call on such a weight, so a
decode row differs from it by the activations' E4M3 rounding, as a row's bits already depend on its path.

Kernel choice by the call's rows and the weight's rows (the only way a row's rounding can depend on its batch):
the dequant-GEMV (:mod:`~ninfer.ops.triton.quant_gemv`) for up to :data:`GEMM_MIN_ROWS` - 1 rows, and for up to
:data:`~ninfer.ops.triton.quant_gemv.MAX_ROWS` rows of a weight with fewer than :data:`GEMM_MIN_N` rows; else the
tensor-core GEMM (:mod:`~ninfer.ops.triton.quant_gemm`). The GEMV decodes each weight byte once but multiplies it
on the CUDA cores once per row of x, so its cost grows with the rows; the GEMM decodes the same bytes into tensor-core
operands whose cost does not grow up to 16 rows, but takes 64 weight rows a program and does not split K, so it
needs a weight with many rows to fill the device (docs/kernels.md has the measured crossover). The fused norm and SwiGLU variants take
the GEMV's prologue/epilogue for one row (the decode step), else the Triton norm, the product and the Triton
``silu_and_mul`` in sequence. q4, q8 and fp8 weights with bf16 activations of up to 8 rows take the tensor-core
GEMVs (:mod:`~ninfer.ops.triton.quant_gemv_tc`, :mod:`~ninfer.ops.triton.quant_gemv_tc8`) where
:func:`tc_module` says (``NINFER_QUANT_GEMV``: ``auto`` by the measured table :data:`AUTO_TC`, ``tc``, ``cuda``)
instead, with the norm formed in its programs and the SwiGLU applied
where its partials are added. Activations of another dtype than the kernels take go to the reference ops.
``NINFER_QUANT_NORM=separate`` (a candidate until timed in a decode step) forms the norm in the Triton norm kernel
first and runs the same GEMV without its prologue (the SwiGLU stays in the GEMV): the normed rows are then the norm
kernel's, which may differ from the prologue's by one ulp of x's dtype.
"""

from __future__ import annotations

import os

import torch

from ninfer.ops.reference import quantized as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import activation as _activation
from ninfer.ops.triton import norm as _norm
from ninfer.ops.triton import quant_gemv_streamk, quant_gemv_tc, quant_gemv_tc8, quant_nvfp4
from ninfer.ops.triton._common import KERNEL_DTYPES, launch_ok
from ninfer.ops.triton._quant import KERNEL_FORMATS, KIND_NVFP4, KernelWeight, check_input, kernel_weight
from ninfer.ops.triton.quant_gemm import gemm, gemm_a8
from ninfer.ops.triton.quant_gemv import MAX_ROWS, gemv
from ninfer.quant import PackedWeight


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


#: Rows of x from which a weight of at least GEMM_MIN_N rows takes the tensor-core GEMM instead of the GEMV.
GEMM_MIN_ROWS = 4
#: Weight rows from which the GEMM fills the device (at 64 rows a program: 128 programs).
GEMM_MIN_N = 8192
#: Where the fused norm ops form the norm when the GEMV takes the call (``NINFER_QUANT_NORM``, read once): ``fused``
#: (the default) in every program of the GEMV, ``separate`` in the Triton norm kernel before it.
NORM_MODE = os.environ.get("NINFER_QUANT_NORM", "fused")
if NORM_MODE not in ("fused", "separate"):
    raise ValueError(f"NINFER_QUANT_NORM={NORM_MODE!r}: expected one of fused, separate")


def takes_gemv(rows: int, w: KernelWeight) -> bool:
    """Whether a call of ``rows`` rows of x with ``w`` runs the GEMV (else the GEMM)."""
    return rows <= MAX_ROWS and (rows < GEMM_MIN_ROWS or w.n < GEMM_MIN_N)


#: Where ``NINFER_QUANT_GEMV=auto`` runs the tensor-core GEMVs, by format: (fewest rows of x, whether they also
#: replace the GEMM). Measured kernel by kernel on the 9B projections at 1 and 8 rows (docs/kernels.md): q4 wins
#: everywhere, over the GEMM too; fp8 loses to the CUDA-core GEMV at one row on the narrower projections and wins
#: at eight, over the GEMM too; q8 wins over the GEMV at eight rows but loses to the GEMM on the LM head.
AUTO_TC = {"q4_g64_fp16": (1, True), "fp8_e4m3fn_row_bf16": (2, True), "q8_g32_fp16": (2, False)}


def tc_module(x2: torch.Tensor, w: KernelWeight):
    """The tensor-core GEMV module that runs ``x2`` with ``w`` under ``NINFER_QUANT_GEMV`` (q4:
    :mod:`~ninfer.ops.triton.quant_gemv_tc`, or :mod:`~ninfer.ops.triton.quant_gemv_streamk` under
    ``NINFER_QUANT_SPLIT=streamk``; q8/fp8: :mod:`~ninfer.ops.triton.quant_gemv_tc8`), or None."""
    mode = quant_gemv_tc.MODE
    if mode == "cuda" or x2.dtype != torch.bfloat16:
        return None
    module = next((m for m in (quant_gemv_tc, quant_gemv_tc8) if m.launch_shape(x2.shape[0], w) is not None), None)
    if module is quant_gemv_tc and quant_gemv_tc.SPLIT_RULE == "streamk":
        module = quant_gemv_streamk
    if module is None or mode == "tc":
        return module
    fewest, over_gemm = AUTO_TC.get(w.format, (MAX_ROWS + 1, False))
    rows = x2.shape[0]
    return module if rows >= fewest and (over_gemm or takes_gemv(rows, w)) else None


def product(x2: torch.Tensor, w: KernelWeight, out_dtype: torch.dtype | None = None, *,
            a8: bool = False) -> torch.Tensor:
    """``x2[M, K] @ decode(w).T``: the GEMV where :func:`takes_gemv`, else the GEMM (with ``a8``, above MAX_ROWS
    rows, the A8 GEMM)."""
    if x2.shape[0] == 0:
        return torch.empty((0, w.n), dtype=out_dtype or x2.dtype, device=x2.device)
    if w.kind == KIND_NVFP4:
        kernel = quant_nvfp4.gemv if takes_gemv(x2.shape[0], w) else quant_nvfp4.gemm
        return kernel(x2, w, out_dtype=out_dtype)
    tc = tc_module(x2, w)
    if tc is not None:
        return tc.gemv_tc(x2, w, out_dtype=out_dtype)
    if takes_gemv(x2.shape[0], w):
        return gemv(x2, w, out_dtype=out_dtype)
    if a8 and x2.shape[0] > MAX_ROWS:
        return gemm_a8(x2, w, out_dtype=out_dtype)
    return gemm(x2, w, out_dtype=out_dtype)


def _prepare(x: torch.Tensor, weight: PackedWeight, op: str) -> KernelWeight | None:
    """The kernel view of ``weight``, or None when x's dtype is not one the kernels take (the reference runs)."""
    w = kernel_weight(weight, op)
    check_input(x, w, op)
    if x.dtype not in KERNEL_DTYPES:
        return None
    launch_ok(x)
    return w


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x[..., K] @ decode(weight).T -> [..., N]`` in x's dtype."""
    w = _prepare(x, weight, "linear")
    if w is None:
        return _reference.linear(x, weight)
    return product(_rows(x, w.k), w, a8=_a8(weight)).view(*x.shape[:-1], w.n)


def _a8(weight: PackedWeight) -> bool:
    return weight.activations == "a8"


def logits(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``linear(x, weight).float()``, stored as fp32 by the kernel (no separate cast)."""
    w = _prepare(x, weight, "logits")
    if w is None:
        return _reference.logits(x, weight)
    return product(_rows(x, w.k), w, torch.float32, a8=_a8(weight)).view(*x.shape[:-1], w.n)


def _norm_args(x, residual, norm_weight, op: str) -> None:
    n_in = x.shape[-1]
    if residual.shape != x.shape or norm_weight.shape != (n_in,):
        raise ValueError(f"{op}: x {tuple(x.shape)}, residual {tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}")


def _takes_fused(x: torch.Tensor, residual: torch.Tensor, w: KernelWeight) -> bool:
    """Whether the norm (and SwiGLU) run inside the product's kernels: one row on the CUDA-core GEMV, or the rows
    a tensor-core GEMV takes."""
    if residual.dtype != x.dtype or w.kind == KIND_NVFP4:
        return False
    return x.numel() == x.shape[-1] or tc_module(_rows(x, w.k), w) is not None


def _fused_norm(x, residual, norm_weight, eps, w: KernelWeight, swiglu: bool):
    """The rows through the GEMV with the norm prologue (``NORM_MODE`` ``separate``: after the norm kernel), and
    the SwiGLU epilogue."""
    n_in = x.shape[-1]
    x2, r2 = _rows(x, n_in), _rows(residual, n_in)
    tc = tc_module(x2, w)
    kernel = gemv if tc is None else tc.gemv_tc
    if NORM_MODE == "separate":
        normed, new_residual = _norm.add_rms_norm_unit_offset(x2, r2, norm_weight, eps)
        y = kernel(normed, w, swiglu=swiglu)
    else:
        normed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        y = kernel(x2, w, norm=(r2, norm_weight.contiguous(), eps, normed, new_residual), swiglu=swiglu)
    lead = x.shape[:-1]
    return y.view(*lead, y.shape[-1]), normed.view(*lead, n_in), new_residual.view(*lead, n_in)


def add_rms_norm_unit_offset_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(linear(normed, weight), normed, new_residual)`` for ``normed, new_residual =
    add_rms_norm_unit_offset(x, residual, norm_weight, eps)``."""
    op = "add_rms_norm_unit_offset_linear"
    _norm_args(x, residual, norm_weight, op)
    w = _prepare(x, weight, op)
    if w is None:
        return _reference.add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, weight)
    if _takes_fused(x, residual, w):
        return _fused_norm(x, residual, norm_weight, eps, w, swiglu=False)
    normed, new_residual = _norm.add_rms_norm_unit_offset(x, residual, norm_weight, eps)
    return product(_rows(normed, w.k), w, a8=_a8(weight)).view(*x.shape[:-1], w.n), normed, new_residual


def add_rms_norm_unit_offset_swiglu(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    gate_up: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(silu_and_mul(linear(normed, gate_up)), normed, new_residual)``; gate_up is ``[2I, K]``."""
    op = "add_rms_norm_unit_offset_swiglu"
    if gate_up.shape[0] % 2:
        raise ValueError(f"{op}: gate_up has {gate_up.shape[0]} rows, not [2I, N]")
    _norm_args(x, residual, norm_weight, op)
    w = _prepare(x, gate_up, op)
    if w is None:
        return _reference.add_rms_norm_unit_offset_swiglu(x, residual, norm_weight, eps, gate_up)
    if _takes_fused(x, residual, w):
        return _fused_norm(x, residual, norm_weight, eps, w, swiglu=True)
    y, normed, new_residual = add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, gate_up)
    return _activation.silu_and_mul(y), normed, new_residual


_CUDA = frozenset({"cuda"})
_FORMATS = KERNEL_FORMATS
OPS = [OpImpl(op=name, name="triton_quant", fn=fn, devices=_CUDA, dtypes=KERNEL_DTYPES, priority=10,
              weight_formats=_FORMATS)
       for name, fn in (("linear", linear), ("logits", logits),
                        ("add_rms_norm_unit_offset_linear", add_rms_norm_unit_offset_linear),
                        ("add_rms_norm_unit_offset_swiglu", add_rms_norm_unit_offset_swiglu))]
