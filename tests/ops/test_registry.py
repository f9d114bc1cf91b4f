"""Op contracts come from plugins (``ninfer_op_contracts``) and implementations are checked against them when ops
are resolved: core alone resolves its own ops, an architecture plugin adds contracts with its implementations, and
an implementation of an op no installed plugin defines is an error naming the op and where it came from."""

import pytest
import torch
from ninfer.ops import CORE_CONTRACTS, OpContract, OpError, OpImpl, resolve_ops
from ninfer.plugins import PluginConflictError, PluginRegistry, get_registry, hookimpl


def _double(x):
    return 2 * x


class _ToyOps:
    """An in-process plugin that defines one op and implements it."""

    __name__ = "toy_ops"

    @hookimpl
    def ninfer_op_contracts(self):
        return [OpContract("toy_double", "toy_double(x) -> x", "2 * x, exactly.")]

    @hookimpl
    def ninfer_ops(self):
        return [OpImpl(op="toy_double", name="toy_reference", fn=_double)]


class _ClashingContract:
    __name__ = "clashing_ops"

    @hookimpl
    def ninfer_op_contracts(self):
        return [OpContract("linear", "linear(x, w)", "something else")]


def test_core_alone_defines_and_implements_its_generic_ops():
    reg = PluginRegistry(load_entry_points=False)
    assert set(reg.op_contracts) == {c.name for c in CORE_CONTRACTS}
    info = {p.name: p for p in reg.plugins()}["reference_ops"]
    assert set(info.registered["op_contracts"]) == set(reg.op_contracts)
    ops = resolve_ops(reg.ops, "cpu", torch.float32, contracts=reg.op_contracts)
    assert set(ops.describe()) == set(reg.op_contracts)      # a reference implementation for every core op


def test_a_plugin_registers_a_contract_with_its_implementation():
    reg = PluginRegistry(load_entry_points=False, extra_plugins=(_ToyOps(),))
    assert reg.op_contracts["toy_double"].semantics == "2 * x, exactly."
    ops = resolve_ops(reg.ops, "cpu", torch.float32, contracts=reg.op_contracts)
    assert ops.toy_double(torch.tensor([1.5])).item() == 3.0
    assert ops.implementation("toy_double").name == "toy_reference"


def test_an_implementation_of_an_undefined_op_is_rejected_at_resolution_naming_op_and_plugin():
    orphan = OpImpl(op="toy_double", name="toy_reference", fn=_double)   # building it is fine
    reg = PluginRegistry(load_entry_points=False)
    with pytest.raises(OpError) as err:
        resolve_ops(reg.ops + [orphan], "cpu", torch.float32, contracts=reg.op_contracts)
    message = str(err.value)
    assert "'toy_double'" in message and _double.__module__ in message
    assert f"plugin package {_double.__module__.split('.')[0]!r}" in message and "ninfer_op_contracts" in message
    # Checked for every implementation, also those this device or dtype would not pick.
    cuda_only = OpImpl(op="toy_double", name="k", fn=_double, devices=frozenset({"cuda"}), priority=10)
    with pytest.raises(OpError, match="toy_double"):
        resolve_ops(reg.ops + [cuda_only], "cpu", torch.float32, contracts=reg.op_contracts)


def test_a_defined_op_without_implementation_says_so_and_other_names_are_attribute_errors():
    contracts = {c.name: c for c in CORE_CONTRACTS}
    contracts["toy_double"] = OpContract("toy_double", "toy_double(x) -> x", "2 * x")
    ops = resolve_ops([], "cpu", torch.float32, contracts=contracts)
    with pytest.raises(OpError, match="'toy_double' has no implementation for device 'cpu'"):
        ops.toy_double(torch.ones(1))
    with pytest.raises(AttributeError):
        ops.not_an_op  # noqa: B018


def test_default_contracts_are_the_process_registry_s():
    reg = get_registry()
    toy = OpImpl(op="toy_double", name="toy_reference", fn=_double)
    with pytest.raises(OpError, match="toy_double"):
        resolve_ops([toy], "cpu", torch.float32)
    ops = resolve_ops(reg.ops, "cpu", torch.float32)
    assert set(ops.describe()) <= set(reg.op_contracts)


def test_two_plugins_cannot_define_the_same_op():
    with pytest.raises(PluginConflictError, match="'linear'.*'reference_ops'.*'clashing_ops'"):
        PluginRegistry(load_entry_points=False, extra_plugins=(_ClashingContract(),))


def test_the_qwen_plugin_defines_the_ops_only_its_models_call():
    from ninfer_qwen3_5.ops.contracts import CONTRACTS
    from ninfer_qwen3_5.ops.registration import op_impls

    reg = PluginRegistry(only={"qwen3_5"})
    qwen = {c.name for c in CONTRACTS}
    assert {"gdn_decode", "causal_conv1d_update", "mrope_cos_sin", "gated_rms_norm"} <= qwen
    assert qwen.isdisjoint(c.name for c in CORE_CONTRACTS)
    info = {p.name: p for p in reg.plugins()}["qwen3_5"]
    assert set(info.registered["op_contracts"]) == qwen
    # Its implementations (reference here, kernels too where they can run) are exactly of its own ops.
    assert {i.op for i in op_impls()} == qwen
    ops = resolve_ops(reg.ops, "cpu", torch.float32, contracts=reg.op_contracts)
    assert set(ops.describe()) == set(reg.op_contracts)
