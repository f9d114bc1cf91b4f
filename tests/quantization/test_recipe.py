"""Converter recipes: presets, TOML files, and the errors that name what is wrong."""

from __future__ import annotations

import pytest
from ninfer.artifact import ArtifactReader
from ninfer.conversion import convert
from ninfer.conversion.recipe import RecipeError, load_recipe

MATMUL_SUFFIXES = ("attention/query", "attention/key", "attention/value", "attention/gate", "attention/out",
                   "gdn/qkv", "gdn/z", "gdn/b", "gdn/a", "gdn/out", "mlp/gate_up", "mlp/down", "text/lm_head")


def _formats(path):
    with ArtifactReader(path) as r:
        d = r.directory
        return {name: d.object_index[b.object_ids()[0]].format for name, b in d.bindings.items()}


@pytest.mark.parametrize("preset,fmt", [("q8", "q8_g32_fp16"), ("q4", "q4_g64_fp16"), ("q6", "q6_g64_fp16"),
                                        ("fp8", "fp8_e4m3fn_row_bf16")])
def test_uniform_presets_quantize_matmul_weights_only(checkpoints, tmp_path, preset, fmt):
    out = tmp_path / "m.ninfer"
    result = convert(checkpoints["dense"], out, progress=False, quantize=preset)
    formats = _formats(out)
    for name, got in formats.items():
        want = fmt if name.endswith(MATMUL_SUFFIXES) else "fp32"
        assert got == want, name
    assert set(result.quantized.values()) == {fmt}
    with ArtifactReader(out) as r:
        prov = r.directory.provenance
        assert prov["quantization"]["recipe"] == preset
        assert {u.activation_policy for u in r.directory.uses if formats[u.parameter] == fmt} == {"A16Only"}


def test_mixed_preset_on_moe(checkpoints, tmp_path):
    out = tmp_path / "m.ninfer"
    convert(checkpoints["moe"], out, progress=False, quantize="mixed")
    f = _formats(out)
    assert f["text/layers/0/moe/experts/gate_up"] == f["text/layers/0/moe/experts/down"] == "q4_g64_fp16"
    assert f["text/lm_head"] == "q6_g64_fp16"
    assert f["text/layers/0/gdn/qkv"] == f["text/layers/3/attention/query"] == "q8_g32_fp16"
    assert f["text/layers/0/moe/shared/down"] == "q8_g32_fp16"
    assert f["text/layers/0/moe/router"] == f["text/layers/0/moe/shared/gate"] == "fp32"
    assert f["text/embed"] == f["text/norm"] == f["text/layers/0/gdn/A_log"] == "fp32"


def test_toml_recipe(checkpoints, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('base = "q8"\n[formats]\n"text/lm_head" = "keep"\n"*/mlp/*" = "q4_g64_fp16"\n')
    out = tmp_path / "m.ninfer"
    convert(checkpoints["dense"], out, progress=False, quantize=str(recipe))
    f = _formats(out)
    assert f["text/lm_head"] == "fp32"
    assert f["text/layers/1/mlp/down"] == "q4_g64_fp16"
    assert f["text/layers/1/gdn/out"] == "q8_g32_fp16"


@pytest.mark.parametrize("body,match", [
    ('[formats]\n"text/layers/*/mlp/nonexistent" = "q8_g32_fp16"\n', "'text/layers/\\*/mlp/nonexistent' matches no"),
    ('[formats]\n"text/norm" = "q8_g32_fp16"\n', "'text/norm'.*not a matmul weight"),
    ('[formats]\n"*/gdn/qkv" = "q4_g64_fp16"\n', "object 'text/layers/0/gdn/in_proj' holds.*one format"),
    ('[formats]\n"*" = "q3_g64_fp16"\n', "'q3_g64_fp16' is unknown"),
    ('[formats]\n"*" = "bf16"\n', "raw format; use keep"),
    ('[formats]\n"*/mlp/down" = "nvfp4"\n', r"mlp/down.*which nvfp4 cannot hold: it needs N % 128 == 0"),
    ('base = "q9"\n', "base 'q9' is not a preset"),
    ('[format]\n', "unknown key 'format'"),
    ('[formats]\n"*" = "keep"\n', "quantizes nothing: no matmul weight of this model matches its rules"),
])
def test_recipe_errors_name_the_problem(checkpoints, tmp_path, body, match):
    recipe = tmp_path / "r.toml"
    recipe.write_text(body)
    out = tmp_path / "m.ninfer"
    with pytest.raises(RecipeError, match=match):
        convert(checkpoints["dense"], out, progress=False, quantize=str(recipe))
    assert not out.exists()


def test_search_method_is_recorded(checkpoints, tmp_path):
    out = tmp_path / "m.ninfer"
    convert(checkpoints["dense"], out, progress=False, quantize="q4+search")
    with ArtifactReader(out) as r:
        prov = r.directory.provenance
    assert prov["quantization"]["method"] == "search"
    assert {c["rounding"] for c in prov["casts"]} == {"SEARCH_MSE_F16_RECIP"}
    recipe = tmp_path / "r.toml"
    recipe.write_text('base = "q4"\nmethod = "gptq"\n')
    with pytest.raises(RecipeError, match="method 'gptq' is not one of rtn, search"):
        load_recipe(str(recipe))


def test_unknown_preset_and_nvfp4():
    with pytest.raises(RecipeError, match="neither a preset"):
        load_recipe("q3")
    assert load_recipe("nvfp4").rules == (("*", "nvfp4"),)


def test_a_mapping_without_uses_quantizes_nothing_and_says_why():
    """A source mapping that declares no UsePlan marks no parameter as a matmul weight: a recipe would keep every
    object as stored, which is refused instead of writing a full-precision artifact the user did not ask for."""
    from types import SimpleNamespace

    from ninfer.conversion.recipe import assign

    plan = SimpleNamespace(uses=(), bindings=(SimpleNamespace(name="text/lm_head", object="text/lm_head", parts=()),))
    with pytest.raises(RecipeError, match=r"recipe 'q8' quantizes nothing: the source mapping declares no weight "
                                          r"uses \(UsePlan\)"):
        assign(load_recipe("q8"), plan, {"text/lm_head": (8, 4)})


def test_nvfp4_on_shapes_it_cannot_hold_says_so():
    """The preset selects the matmul weight, but nvfp4's layout cannot hold its shape: the refusal names the
    layout, not the rules."""
    from types import SimpleNamespace

    from ninfer.conversion.recipe import assign

    plan = SimpleNamespace(uses=(SimpleNamespace(parameter="text/lm_head", activation_policy="A16Only"),),
                           bindings=(SimpleNamespace(name="text/lm_head", object="text/lm_head", parts=()),))
    with pytest.raises(RecipeError, match=r"recipe 'nvfp4' quantizes nothing: nvfp4 cannot hold any of the matmul "
                                          r"weights it selects \(e\.g\. 'text/lm_head', shape \[8, 4\]: it needs "
                                          r"N % 128 == 0"):
        assign(load_recipe("nvfp4"), plan, {"text/lm_head": (8, 4)})
