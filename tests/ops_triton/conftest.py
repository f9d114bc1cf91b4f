"""Mechanics for the Triton kernel suite: where the kernels run and how their OpSet is built.

With a CUDA device the kernels run compiled on "cuda" and are reached through the real plugin hook
(``ninfer.ops.triton.plugin.ninfer_ops`` + ``resolve_ops``: the registration is exercised, and the GPU box
has no installed entry points). Without one, ``TRITON_INTERPRET=1`` is set here, before any test module
imports triton, and the same kernels run on CPU tensors through triton's interpreter at tiny sizes; the
plugin then (correctly) registers nothing, so the OpSet is built from its implementation list moved to
"cpu". Test modules skip cleanly when triton is not installed (module-level ``pytest.importorskip``).

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


def triton_ops(dtype: torch.dtype):
    """The OpSet the engine would get on DEVICE, with the Triton kernels taking precedence."""
    from ninfer.ops import resolve_ops
    from ninfer.ops.reference.plugin import ninfer_ops as reference_ops
    from ninfer.ops.triton import plugin

    if CUDA:
        impls = plugin.ninfer_ops()
        assert impls, "CUDA and triton present, yet the triton plugin registered nothing"
    else:
        impls = [dataclasses.replace(i, devices=frozenset({"cpu"})) for i in plugin.triton_op_impls()]
    ops = resolve_ops(reference_ops() + impls, DEVICE, dtype, force="")
    return ops


def reference(dtype: torch.dtype):
    from ninfer.ops import resolve_ops
    from ninfer.ops.reference.plugin import ninfer_ops as reference_ops

    return resolve_ops(reference_ops(), DEVICE, dtype, force="reference")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test id (as in tests/ops): fresh, reproducible inputs per test."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
