"""ConversionPlan invariants, checked before any byte is written."""

from __future__ import annotations

import pytest
from ninfer.artifact.source_mapping import (
    BindingPlan,
    ComponentPlan,
    ConversionPlan,
    ObjectPlan,
    Part,
    SourceRows,
    SourceTensor,
    UsePlan,
)
from ninfer.conversion.errors import PlanError
from ninfer.conversion.plan import check_plan

TEXT = ComponentPlan("text", {"architectures": ["X"]})
TENSORS = {
    "q": SourceTensor("q", (4, 3), "BF16"),
    "k": SourceTensor("k", (2, 3), "BF16"),
    "n": SourceTensor("n", (3,), "F32"),
    "ids": SourceTensor("ids", (5,), "I64"),
    "odd": SourceTensor("odd", (2, 4), "BF16"),
    "h": SourceTensor("h", (2, 3), "F16"),
}


def plan(objects=(), bindings=(), uses=(), ignored=None, components=(TEXT,)):
    return ConversionPlan(tuple(components), tuple(objects), tuple(bindings), tuple(uses), dict(ignored or {}))


BASE_IGNORED = {"ids": "unused", "odd": "unused", "h": "unused"}
QK = ObjectPlan("qk", "text", ("q", "k"))
N = ObjectPlan("n", "text", ("n",))


def test_valid_plan_resolves_shapes_formats_and_casts():
    checked = check_plan(plan([QK, ObjectPlan("n", "text", ("n",), "bf16")],
                              [BindingPlan("query", parts=(Part("qk", 0, 12),)),
                               BindingPlan("key", parts=(Part("qk", 12, 18),)), BindingPlan("norm", object="n")],
                              [UsePlan("query", "in", "AllowA8")], BASE_IGNORED), TENSORS)
    qk, n = checked.objects
    assert (qk.shape, qk.format, qk.cast, qk.nbytes) == ((6, 3), "bf16", False, 36)
    assert (n.shape, n.dtype, n.format, n.cast) == ((3,), "F32", "bf16", True)
    assert checked.casts == (n,)


def test_unconsumed_tensor_is_named():
    with pytest.raises(PlanError, match=r"'ids'.*neither converted nor ignored"):
        check_plan(plan([QK, N], ignored={"odd": "", "h": ""}), TENSORS)


def test_tensor_consumed_twice():
    with pytest.raises(PlanError, match=r"'q' is consumed by both object 'qk' and object 'q2'"):
        check_plan(plan([QK, ObjectPlan("q2", "text", ("q",)), N], ignored=BASE_IGNORED), TENSORS)


def test_row_ranges_reorder_a_tensor_inside_one_object():
    # q's rows 2..4, then all of k, then q's rows 0..2: a de-interleave, every row exactly once.
    obj = ObjectPlan("qk", "text", (SourceRows("q", 2, 4), "k", SourceRows("q", 0, 2)))
    checked = check_plan(plan([obj, N], [BindingPlan("x", object="qk")], ignored=BASE_IGNORED), TENSORS)
    assert checked.objects[0].shape == (6, 3)
    one = ObjectPlan("q", "text", (SourceRows("q", 0, 4),))  # one range covering the tensor: shape (4, 3)
    assert check_plan(plan([one, ObjectPlan("k", "text", ("k",)), N], ignored=BASE_IGNORED),
                      TENSORS).objects[0].shape == (4, 3)


@pytest.mark.parametrize(("sources", "message"), [
    ((SourceRows("q", 0, 2), SourceRows("q", 1, 4), "k"), r"row ranges of source tensor 'q' overlap at row 1"),
    ((SourceRows("q", 0, 1), SourceRows("q", 2, 4), "k"), r"row ranges of source tensor 'q' leave a gap at row 1"),
    ((SourceRows("q", 0, 3), "k"), r"row ranges of source tensor 'q' stop at row 3 of 4"),
    ((SourceRows("q", 0, 5), "k"), r"reads rows \[0, 5\) of source tensor 'q', which has 4 rows"),
    ((SourceRows("q", 2, 2), "q", "k"), r"reads rows \[2, 2\)"),
    (("q", SourceRows("q", 0, 4), "k"), r"reads source tensor 'q' both whole and as row ranges"),
    ((SourceRows("q", 0, 4), "q", "k"), r"reads source tensor 'q' more than once"),
    (("q", "q", "k"), r"reads source tensor 'q' more than once"),
])
def test_bad_row_ranges_are_named(sources, message):
    with pytest.raises(PlanError, match=message):
        check_plan(plan([ObjectPlan("qk", "text", sources), N], ignored=BASE_IGNORED), TENSORS)


def test_row_ranges_of_one_tensor_in_two_objects():
    objs = [ObjectPlan("a", "text", (SourceRows("q", 0, 2),)), ObjectPlan("b", "text", (SourceRows("q", 2, 4), "k")), N]
    with pytest.raises(PlanError, match=r"'q' is consumed by both object 'a' and object 'b'"):
        check_plan(plan(objs, ignored=BASE_IGNORED), TENSORS)


def test_row_ranges_of_a_scalar():
    tensors = {**TENSORS, "s": SourceTensor("s", (), "F32")}
    with pytest.raises(PlanError, match=r"rows of source tensor 's', which is a scalar"):
        check_plan(plan([QK, N, ObjectPlan("s", "text", (SourceRows("s", 0, 1),))], ignored=BASE_IGNORED), tensors)


def test_ignored_and_consumed():
    with pytest.raises(PlanError, match=r"'n' is both ignored and consumed"):
        check_plan(plan([QK, N], ignored={**BASE_IGNORED, "n": "x"}), TENSORS)


def test_unknown_names_in_plan():
    with pytest.raises(PlanError, match=r"reads source tensor 'zz'"):
        check_plan(plan([ObjectPlan("z", "text", ("zz",))]), TENSORS)
    with pytest.raises(PlanError, match=r"ignores source tensor 'zz'"):
        check_plan(plan([QK, N], ignored={**BASE_IGNORED, "zz": "x"}), TENSORS)


def test_fused_sources_must_concatenate_along_dim0():
    with pytest.raises(PlanError, match=r"source 'odd' has shape \[2, 4\]"):
        check_plan(plan([ObjectPlan("o", "text", ("q", "odd")), ObjectPlan("k", "text", ("k",)), N],
                        ignored={"ids": "", "h": ""}), TENSORS)
    with pytest.raises(PlanError, match=r"source 'h' has dtype F16"):
        check_plan(plan([ObjectPlan("o", "text", ("q", "h")), ObjectPlan("k", "text", ("k",)), N],
                        ignored={"ids": "", "odd": ""}), TENSORS)


def test_value_preserving_import_needs_a_storage_dtype():
    with pytest.raises(PlanError, match=r"source dtype I64 of 'ids' has no storage format"):
        check_plan(plan([QK, N, ObjectPlan("ids", "text", ("ids",))], ignored={"odd": "", "h": ""}), TENSORS)
    # I64 -> int32 is a supported (range-checked) cast; F32 -> int32 is not.
    check_plan(plan([QK, N, ObjectPlan("ids", "text", ("ids",), "int32")], ignored={"odd": "", "h": ""}), TENSORS)
    with pytest.raises(PlanError, match=r"casting source dtype F32 to int32 is not supported"):
        check_plan(plan([QK, ObjectPlan("n", "text", ("n",), "int32")], ignored=BASE_IGNORED), TENSORS)
    with pytest.raises(PlanError, match=r"format 'q4' is not one of"):
        check_plan(plan([QK, ObjectPlan("n", "text", ("n",), "q4")], ignored=BASE_IGNORED), TENSORS)


@pytest.mark.parametrize("binding, message", [
    (BindingPlan("b", object="missing"), r"names object 'missing'"),
    (BindingPlan("b", parts=(Part("qk", 10, 19),)), r"\[10, 19\) of object 'qk' is empty or outside its 18"),
    (BindingPlan("b", parts=(Part("qk", 3, 3),)), r"empty or outside"),
    (BindingPlan("b", parts=(Part("nope", 0, 1),)), r"part of object 'nope'"),
    (BindingPlan("b", object="qk", parts=(Part("qk", 0, 1),)), r"exactly one of the two"),
    (BindingPlan("b"), r"exactly one of the two"),
])
def test_bad_bindings(binding, message):
    with pytest.raises(PlanError, match=message):
        check_plan(plan([QK, N], [binding], ignored=BASE_IGNORED), TENSORS)


def test_bad_uses_and_duplicate_bindings():
    b = BindingPlan("n", object="n")
    with pytest.raises(PlanError, match=r"use of 'x' at 'in' names no planned binding"):
        check_plan(plan([QK, N], [b], [UsePlan("x", "in")], BASE_IGNORED), TENSORS)
    with pytest.raises(PlanError, match=r"activation policy 'A2'"):
        check_plan(plan([QK, N], [b], [UsePlan("n", "in", "A2")], BASE_IGNORED), TENSORS)
    with pytest.raises(PlanError, match=r"use of 'n' at 'in' is planned twice"):
        check_plan(plan([QK, N], [b], [UsePlan("n", "in"), UsePlan("n", "in")], BASE_IGNORED), TENSORS)
    with pytest.raises(PlanError, match=r"binding 'n' is planned twice"):
        check_plan(plan([QK, N], [b, b], ignored=BASE_IGNORED), TENSORS)


def test_components():
    with pytest.raises(PlanError, match=r"no 'text' component"):
        check_plan(plan([QK, N], ignored=BASE_IGNORED, components=[ComponentPlan("vision", {"architectures": ["V"]})]),
                   TENSORS)
    with pytest.raises(PlanError, match=r"component 'vision' targets 'mtp'"):
        check_plan(plan([QK, N], ignored=BASE_IGNORED,
                        components=[TEXT, ComponentPlan("vision", {"architectures": ["V"]}, target="mtp")]), TENSORS)
    with pytest.raises(PlanError, match=r"object 'n' belongs to component 'mtp'"):
        check_plan(plan([QK, ObjectPlan("n", "mtp", ("n",))], ignored=BASE_IGNORED), TENSORS)
    with pytest.raises(PlanError, match=r"component 'text': config has no non-empty 'architectures'"):
        check_plan(plan([QK, N], ignored=BASE_IGNORED, components=[ComponentPlan("text", {})]), TENSORS)
    with pytest.raises(PlanError, match=r"object 'qk' is planned twice"):
        check_plan(plan([QK, QK, N], ignored=BASE_IGNORED), TENSORS)


def test_empty_tensor_cannot_be_stored():
    tensors = {"e": SourceTensor("e", (0, 3), "BF16")}
    with pytest.raises(PlanError, match=r"object 'e' would have shape \[0, 3\]"):
        check_plan(plan([ObjectPlan("e", "text", ("e",))]), tensors)


def test_not_a_plan():
    with pytest.raises(PlanError, match="not a ConversionPlan"):
        check_plan({"objects": []}, TENSORS)
