"""Mechanics for the Triton kernel suite: where the kernels run and how their OpSet is built.

Kernels come from core (``ninfer.ops.triton``) and from the Qwen3.5 plugin (``ninfer_qwen3_5.ops.triton``, the ops
only its models call), each with its reference implementations. With a CUDA device the kernels run compiled on
"cuda" and are collected as the registration hooks collect them (core's ``triton_ops`` plugin and the Qwen3.5
plugin's ``ops.registration``, then ``resolve_ops``: the GPU box has no installed entry points).
Without one, ``TRITON_INTERPRET=1`` is set here, before any test module imports triton, and the same kernels run
on CPU tensors through triton's interpreter at tiny sizes; the hooks then (correctly) register no kernel, so the
OpSet is built from the implementation lists moved to "cpu". Test modules skip cleanly when triton is not
installed (module-level ``pytest.importorskip``).

Oracles and criteria come from the reference suite (tests/ops): the kernels must pass the tests the torch
reference passes, on the same fp64 oracles.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if CUDA else "cpu"


def reference_impls() -> list:
    """Every torch reference implementation: core's and the Qwen3.5 plugin's."""
    from ninfer.ops.reference.plugin import ninfer_ops as core_reference
    from ninfer_qwen3_5.ops.registration import reference_op_impls

    return core_reference() + reference_op_impls()


def kernel_impls() -> list:
    """Every Triton implementation (core's and the plugin's), on DEVICE."""
    from ninfer.ops.triton import plugin
    from ninfer_qwen3_5.ops import registration

    kernels = plugin.triton_op_impls() + registration.triton_op_impls()
    if CUDA:
        # What the hooks register here: both return their kernels exactly when available() holds.
        assert plugin.available(), "CUDA present, yet the triton hooks would register no kernel"
        return kernels
    return [dataclasses.replace(i, devices=frozenset({"cpu"})) for i in kernels]


def triton_ops(dtype: torch.dtype):
    """The OpSet the engine would get on DEVICE, with the Triton kernels taking precedence."""
    from ninfer.ops import resolve_ops

    return resolve_ops(reference_impls() + kernel_impls(), DEVICE, dtype, force="")


def reference(dtype: torch.dtype):
    from ninfer.ops import resolve_ops

    return resolve_ops(reference_impls(), DEVICE, dtype, force="reference")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test id (as in tests/ops): fresh, reproducible inputs per test."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def qwen_program(case, ops_kind: str):
    """A Qwen3.5 Program of a tests/models/qwen3_5 harness case on DEVICE in fp32, on the Triton kernels
    (``ops_kind="triton"``) or the torch reference ops only (``"reference"``)."""
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.ops import resolve_ops

    impls = reference_impls() + (kernel_impls() if ops_kind == "triton" else [])
    ops = resolve_ops(impls, DEVICE, torch.float32, force="reference" if ops_kind == "reference" else "")
    options = ProgramOptions(device=torch.device(DEVICE), dtype=torch.float32, max_sequences=4, page_size=4,
                             num_pages=128, max_context=256)
    weights = {k: v.to(DEVICE) for k, v in case.weights.items()}
    return case.spec.create_program(ProgramInit(config=case.config, weights=weights, ops=ops, options=options))


@pytest.fixture
def cuda_core_gemv(monkeypatch):
    """The dense quantized ops without the tensor-core GEMVs (``NINFER_QUANT_GEMV=cuda``): for the tests of the
    CUDA-core GEMV and the GEMM through the ops, whose bounds are theirs (test_quant_gemv_tc_triton.py covers the
    rest)."""
    from ninfer.ops.triton import quant_gemv_tc

    monkeypatch.setattr(quant_gemv_tc, "MODE", "cuda")


class CountLaunches:
    """Stands in for a Triton kernel (``kernel[grid](...)``): counts launches, keeps each launch's keyword arguments
    (``calls``: constexprs and launch options) and runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.calls = kernel, 0, []

    def __getitem__(self, grid):
        self.launches += 1

        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch
