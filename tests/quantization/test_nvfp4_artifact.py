"""nvfp4 as a loadable format: the ``block_scale_k16_m128x4_v1`` layout (codes, 128x4 scale tiles, the divisor),
the converter's streaming writer, the recipe's layout constraint, the CPU reference ops through the engine, and
the CUDA ops that read it (dense ops and MoE experts). Its packed views and the binder's 128-row tiles are in
test_loading.py."""

from __future__ import annotations

import io

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.conversion import convert
from ninfer.conversion.quantize import write_quantized
from ninfer.conversion.recipe import RecipeError
from ninfer.quant import PackedWeight, encoded_size, nvfp4, packed_view
from ninfer.quant.errors import QuantizationError
from support.models import tiny_text_model, write_byte_tokenizer

E, N, K = 2, 256, 128


def test_layout_size_and_scale_tiles():
    # the container's worked size: an NVFP4 parent [14336, 5120] is 41,287,684 bytes
    assert encoded_size("nvfp4", (14336, 5120)) == 41_287_684
    assert nvfp4.plane_offsets(256, 128) == (256 * 64, 256 * 64 + 256 * 8, 256 * 72 + 4)
    rows, cols = 256, 8
    scales = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    tiles = nvfp4.tile_scales(scales)
    assert tiles.shape == (2, 2 * 512)
    for r, c in ((0, 0), (1, 0), (31, 3), (32, 0), (127, 2), (128, 5), (255, 7), (200, 6)):
        tile = tiles[r // 128, (c // 4) * 512:(c // 4 + 1) * 512]
        assert int(tile[(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4]) == int(scales[r, c])
    assert torch.equal(nvfp4.untile_scales(tiles, cols * 16), scales)
    for shape in ((100, 128), (128, 96), (128,)):
        with pytest.raises(QuantizationError, match="nvfp4"):
            encoded_size("nvfp4", shape)


def _sources(*shapes, seed=9):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*s, generator=g) for s in shapes]
    files = []
    for i, t in enumerate(tensors):
        f = io.BytesIO(t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
        f.name = f"src{i}"
        files.append(f)
    return tensors, files


def test_streamed_encoding_equals_the_whole_tensors_encoding():
    # Three sources whose row counts do not end on 128-row tiles (a fused object's parts); any chunk size.
    tensors, files = _sources((100, K), (60, K), (96, K))
    whole = torch.cat(tensors).to(torch.bfloat16).float()

    def run(chunk_bytes: int) -> bytes:
        out = bytearray()
        spans = [(f.name, f, 0, len(f.getvalue())) for f in files]
        n = write_quantized(lambda data: out.extend(bytes(data)), "obj", "nvfp4", "BF16", K, spans, chunk_bytes,
                            lambda _: None)
        assert n == len(out)
        return bytes(out)

    data = run(1 << 20)
    assert data == run(K * 2 * 7) and len(data) == encoded_size("nvfp4", (256, K))
    codes, scales, divisor = nvfp4.encode(whole)
    parent = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pw = packed_view("nvfp4", parent, (256, K), 0, 256 * K, (256, K))
    assert torch.equal(pw.planes[0], codes) and torch.equal(pw.planes[1], nvfp4.tile_scales(scales))
    assert float(pw.planes[2][0]) == pytest.approx(divisor, rel=1e-7)
    assert torch.equal(pw.dequantize(torch.float64), nvfp4.decode(codes, scales, float(pw.planes[2][0]),
                                                                  torch.float64))
    # a row block is whole 128-row tiles, sharing the divisor
    block = packed_view("nvfp4", parent, (256, K), 128 * K, 256 * K, (128, K))
    assert torch.equal(block.dequantize(), pw.dequantize()[128:])
    with pytest.raises(QuantizationError, match="128-row scale tiles"):
        packed_view("nvfp4", parent, (256, K), 64 * K, 192 * K, (128, K))


@pytest.fixture(scope="module")
def moe128(tmp_path_factory):
    """A tiny Qwen3.5 MoE whose expert banks, shared expert, LM head and query/gate projections fit nvfp4's
    layout (128-row multiples, K a multiple of 64) and whose key/value rows do not."""
    geometry = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                    num_hidden_layers=4, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=128, shared_expert_intermediate_size=128)
    model = tiny_text_model("moe", geometry, seed=3)
    model.config.architectures = ["Qwen3_5MoeForCausalLM"]
    model.config.eos_token_id = 258
    folder = tmp_path_factory.mktemp("nvfp4_ckpt") / "moe"
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder, {n: p.detach().float() for n, p in model.named_parameters()}


def test_the_preset_quantizes_what_fits_and_loads_the_encoders_values(moe128, tmp_path):
    from ninfer.contracts.features import StartupFeatures
    from ninfer_qwen3_5.parameters import parameter_specs

    folder, params = moe128
    out = tmp_path / "m.ninfer"
    convert(folder, out, progress=False, quantize="nvfp4")
    with ArtifactReader(out) as r:
        formats = {o.id: o.format for o in r.directory.objects if getattr(o, "format", None)}
        w = load_weights(r, parameter_specs(r.directory.components["text"].config, StartupFeatures()), "cpu")
    nv = {oid for oid, f in formats.items() if f == "nvfp4"}
    assert "text/lm_head" in nv and any("experts" in oid for oid in nv)
    assert not any("attention/in_proj" in oid for oid in nv)    # its key rows end off a 128-row tile: kept
    # The LM head holds the encoder's values of the source tensor, divisor included.
    head = w["text/lm_head"]
    assert isinstance(head, PackedWeight) and head.format == "nvfp4"
    src = params["lm_head.weight"]   # the checkpoint is fp32: the converter encodes its values as they are
    codes, scales, divisor = nvfp4.encode(src)
    assert torch.equal(head.dequantize(torch.float64), nvfp4.decode(codes, scales, float(head.planes[2][0]),
                                                                    torch.float64))
    assert float(head.planes[2][0]) == pytest.approx(divisor, rel=1e-7)


def test_the_search_preset_records_its_encoder_and_stores_the_searched_codes(moe128, tmp_path):
    folder, params = moe128
    out = tmp_path / "s.ninfer"
    convert(folder, out, progress=False, quantize="nvfp4+search")
    with ArtifactReader(out) as r:
        prov = r.directory.provenance
        data = torch.frombuffer(bytearray(r.read_object("text/lm_head")), dtype=torch.uint8)
    assert prov["quantization"]["method"] == "search"
    assert nvfp4.SEARCH_ENCODER in {c["rounding"] for c in prov["casts"]}
    src = params["lm_head.weight"]
    codes, scales, _ = nvfp4.encode(src, search=True)
    pw = packed_view("nvfp4", data, tuple(src.shape), 0, src.numel(), tuple(src.shape))
    assert torch.equal(pw.planes[0], codes) and torch.equal(nvfp4.untile_scales(pw.planes[1], src.shape[1]), scales)


def test_an_explicit_rule_on_a_weight_the_layout_cannot_hold_is_refused(moe128, tmp_path):
    folder, _ = moe128
    recipe = tmp_path / "r.toml"
    recipe.write_text('[formats]\n"*/attention/key" = "nvfp4"\n')
    with pytest.raises(RecipeError, match=r"attention/key.*N % 128 == 0, K % 64 == 0"):
        convert(folder, tmp_path / "m.ninfer", progress=False, quantize=str(recipe))


def test_the_default_model_in_nvfp4_scores_close_to_bf16(tmp_path):
    """The trained default model through the engine on the CPU reference ops: 4-bit weights raise its perplexity
    on Python source by about 1%; a misread layout (tiles, divisor, codes) gives another model's logits."""
    import json.decoder

    from ninfer import Engine, EngineOptions
    from ninfer_qwen3_5.default_model import FOLDER

    text = open(json.decoder.__file__, encoding="utf-8").read()[:1500]
    ppl = {}
    for name, q in (("bf16", None), ("nvfp4", "nvfp4")):
        path = tmp_path / f"{name}.ninfer"
        convert(FOLDER, path, progress=False, **({"quantize": q} if q else {}))
        with Engine.start(path, EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=1024),
                          purpose="causal_scoring") as engine:
            ppl[name] = engine.score([text]).overall.perplexity
    assert 0.97 < ppl["nvfp4"] / ppl["bf16"] < 1.05, ppl


def test_cuda_kernels_read_nvfp4_in_the_dense_ops_and_the_experts():
    """The CPU reference ops run every op on nvfp4; on CUDA the Triton dense ops and the MoE expert kernels read it
    too (ops_triton's test_quant_nvfp4_triton.py and test_quant_moe_triton.py check them), so a model storing its
    expert banks and shared expert in nvfp4 passes the load-time format check; a format no op reads does not."""
    pytest.importorskip("triton")
    from ninfer.ops import resolve_ops
    from ninfer.ops.registry import OpError
    from ninfer.ops.triton import quant_linear, quant_moe
    from ninfer.plugins import get_registry

    reg = get_registry()
    cpu = resolve_ops(reg.ops, "cpu", torch.float32, contracts=reg.op_contracts)
    cpu.check_formats("linear", ["nvfp4"])
    cpu.check_formats("moe_experts", ["nvfp4"])
    # This machine may have no CUDA device, so the Triton ops are resolved as the CUDA registration lists them.
    gpu = resolve_ops([*reg.ops, *quant_linear.OPS, *quant_moe.OPS], "cuda", torch.bfloat16,
                      contracts=reg.op_contracts)
    for op in ("linear", "logits", "add_rms_norm_unit_offset_linear", "add_rms_norm_unit_offset_swiglu",
               "moe_experts"):
        gpu.check_formats(op, ["nvfp4"])
    assert gpu.implementation("moe_experts", "nvfp4").fn is quant_moe.moe_experts
    # A model of nvfp4 dense layers and nvfp4 expert banks (either one, and the shared expert's projections) loads
    # on CUDA: every weight finds its op there.
    from ninfer_qwen3_5.model import check_weight_formats
    from ninfer_qwen3_5.parameters import layer_prefix
    dense = {layer_prefix("text", 0) + "/mlp/gate_up": "nvfp4", layer_prefix("text", 0) + "/mlp/down": "nvfp4",
             "text/lm_head": "nvfp4"}
    check_weight_formats(gpu, dense)
    moe = {layer_prefix("text", 1) + "/" + name: "nvfp4"
           for name in ("moe/experts/gate_up", "moe/experts/down", "moe/shared/gate_up", "moe/shared/down")}
    for name, fmt in moe.items():
        check_weight_formats(gpu, {**dense, name: fmt})
    check_weight_formats(gpu, {**dense, **moe})
    # The check still names a format no op reads on the device.
    with pytest.raises(OpError, match="'moe_experts'.*nvfp8.*'cuda'"):
        gpu.check_formats("moe_experts", ["nvfp8"])


def test_a_non_finite_weight_is_refused_naming_the_object():
    t = torch.randn(128, 64)
    t[3, 5] = float("nan")
    f = io.BytesIO(t.numpy().tobytes())
    f.name = "src"
    with pytest.raises(QuantizationError, match="obj: a weight is not finite; nvfp4"):
        write_quantized(lambda d: None, "obj", "nvfp4", "F32", 64, [("src", f, 0, len(f.getvalue()))], 1 << 20,
                        lambda _: None)


def test_block_scale_search_never_worse_than_round_to_nearest():
    """Per block the search's reconstruction error is at most round to nearest's (f = 1 is a candidate), and on
    heavy-tailed weights it is smaller in total; the streamed writer with ``search`` writes the search's codes."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)) ** 3
    err = lambda c, s, d: ((nvfp4.decode(c, s, d, torch.float64) - w.double()) ** 2).reshape(128, -1, 16).sum(-1)  # noqa: E731
    rtn = nvfp4.encode(w)
    found = nvfp4.encode(w, search=True)
    assert found[2] == rtn[2]                                    # the tensor's divisor either way
    assert torch.all(err(*found) <= err(*rtn) * (1 + 1e-9) + 1e-18)
    assert float(err(*found).sum()) < 0.9 * float(err(*rtn).sum())
    src = io.BytesIO(w.numpy().tobytes())
    src.name = "src"
    out = bytearray()
    write_quantized(lambda d: out.extend(bytes(d)), "obj", "nvfp4", "F32", 256, [("src", src, 0, len(src.getvalue()))],
                    1 << 20, lambda _: None, search=True)
    pw = packed_view("nvfp4", torch.frombuffer(out, dtype=torch.uint8), (128, 256), 0, 128 * 256, (128, 256))
    assert torch.equal(pw.planes[0], found[0]) and torch.equal(nvfp4.untile_scales(pw.planes[1], 256), found[1])
