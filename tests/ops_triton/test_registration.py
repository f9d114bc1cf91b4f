"""Where the kernels register: core's Triton plugin implements only core's op contracts, the Qwen3.5 plugin's
kernels only the plugin's own, and every kernel has a torch reference implementation of the same op."""

import pytest

pytest.importorskip("triton")

from .conftest import reference_impls  # noqa: E402


def test_kernels_target_their_own_plugin_s_contracts_and_have_a_reference():
    from ninfer.ops import CORE_CONTRACTS
    from ninfer.ops.triton.plugin import triton_op_impls as core_kernels
    from ninfer_qwen3_5.ops.contracts import CONTRACTS
    from ninfer_qwen3_5.ops.registration import triton_op_impls as qwen_kernels

    core, qwen = {c.name for c in CORE_CONTRACTS}, {c.name for c in CONTRACTS}
    assert {k.op for k in core_kernels()} <= core
    assert {k.op for k in qwen_kernels()} <= qwen
    assert all(k.priority == 10 and k.devices == frozenset({"cuda"}) for k in core_kernels() + qwen_kernels())
    assert {k.op for k in core_kernels() + qwen_kernels()} <= {i.op for i in reference_impls()}
