"""Reader, binder and materializer on quantized objects: packed plane views, never decoded; expert slices of a
quantized bank; bindings a packed weight cannot be viewed through are refused."""

from __future__ import annotations

import pytest
import torch
from ninfer.artifact import ArtifactReader, bind, load_weights
from ninfer.artifact.errors import BindingError
from ninfer.artifact.writer import ArtifactWriter
from ninfer.contracts.architecture import ParameterSpec
from ninfer.contracts.features import StartupFeatures
from ninfer.conversion import convert
from ninfer.quant import PackedWeight, nvfp4
from ninfer.quant.groupwise import GROUPWISE
from ninfer_qwen3_5.parameters import parameter_specs

E, N, K = 4, 8, 64


def _bank_artifact(path, parts, fmt="q4_g64_fp16", shape=(E, N, K)):
    """A bank ``shape`` in ``fmt`` (q4 or nvfp4) bound whole as ``bank`` and by ``parts`` (name -> (begin, end,
    shape)); returns its stored bytes."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).reshape(-1, shape[-1])
    if fmt == "nvfp4":
        codes, scales, divisor = nvfp4.encode(w)
        data = (codes.numpy().tobytes() + nvfp4.tile_scales(scales).numpy().tobytes()
                + torch.tensor([divisor], dtype=torch.float32).view(torch.uint8).numpy().tobytes())
    else:
        spec = GROUPWISE[fmt]
        base, high, scales = spec.encode(w)
        high_off, scale_off, total, _ = spec.plane_offsets(w.shape[0], shape[-1])
        buf = bytearray(total)
        buf[:base.numel()] = base.numpy().tobytes()
        buf[scale_off:] = scales.view(torch.uint8).numpy().tobytes()
        data = bytes(buf)
    wr = ArtifactWriter(path)
    wr.add_component("text", {"architectures": ["Test"]})
    wr.declare_tensor("bank", shape, fmt)
    wr.bind("bank", "bank")
    for name, (b, e, _) in parts.items():
        wr.bind_parts(name, [("bank", b, e)])
    wr.begin_payload()
    wr.write("bank", data)
    wr.finish()
    return data


# An expert and a row block of each bank: q4 rows are addressable one by one, nvfp4's in 128-row scale tiles.
@pytest.mark.parametrize("fmt,shape,rows", [("q4_g64_fp16", (E, N, K), (3, 6)), ("nvfp4", (2, 256, 128), (128, 384))])
def test_expert_slice_and_row_block_of_a_quantized_bank(tmp_path, fmt, shape, rows):
    e, n, k = shape
    r0, r1 = rows
    path = tmp_path / "bank.ninfer"
    stored = _bank_artifact(path, {"expert1": (n * k, 2 * n * k, (n, k)), "rows": (r0 * k, r1 * k, (r1 - r0, k))},
                            fmt, shape)
    with ArtifactReader(path) as r:
        specs = [ParameterSpec("bank", shape), ParameterSpec("expert1", (n, k)), ParameterSpec("rows", (r1 - r0, k))]
        bound = {b.name: b for b in bind(r, specs).parameters}
        assert all(b.quantized and b.format == fmt and b.is_view for b in bound.values())
        w = load_weights(r, specs, "cpu")
    bank, e1, block = w["bank"], w["expert1"], w["rows"]
    assert isinstance(e1, PackedWeight) and e1.shape == (n, k)
    storage = bank.planes[0].untyped_storage().data_ptr()
    for pw in (e1, block):
        assert all(p.untyped_storage().data_ptr() == storage for p in pw.planes)   # views of one parent read
    # the planes are the stored bytes, not decoded values
    assert bank.planes[0].dtype == torch.uint8
    assert bytes(bank.planes[0].numpy().tobytes()) == stored[:bank.planes[0].numel()]
    full = bank.dequantize(torch.float64)
    assert torch.equal(e1.dequantize(torch.float64), full[1])
    assert torch.equal(bank[1].dequantize(torch.float64), full[1])
    assert torch.equal(block.dequantize(torch.float64), full.reshape(-1, k)[r0:r1])


def test_an_nvfp4_binding_off_the_scale_tiles_is_refused(tmp_path):
    path = tmp_path / "bank.ninfer"
    _bank_artifact(path, {"bad": (64 * 128, 192 * 128, (128, 128))}, "nvfp4", (2, 256, 128))
    with ArtifactReader(path) as r, pytest.raises(BindingError, match="'bad'.*tiles of 128 rows"):
        bind(r, [ParameterSpec("bad", (128, 128))])


@pytest.mark.parametrize("begin,end,shape", [(10, 10 + N * K, (N, K)), (0, 2 * K, (2 * K,)), (0, 2 * K, (4, K // 2))])
def test_binding_that_is_not_whole_rows_is_refused(tmp_path, begin, end, shape):
    path = tmp_path / "bank.ninfer"
    _bank_artifact(path, {"bad": (begin, end, shape)})
    with ArtifactReader(path) as r, pytest.raises(BindingError, match="'bad'.*whole rows.*re-order rows at conversion"):
        bind(r, [ParameterSpec("bad", shape)])


def test_converted_moe_loads_packed_views(checkpoints, tmp_path):
    out = tmp_path / "moe.ninfer"
    convert(checkpoints["moe"], out, progress=False, quantize="mixed")
    with ArtifactReader(out) as r:
        specs = parameter_specs(r.directory.components["text"].config, StartupFeatures())
        w = load_weights(r, specs, "cpu")
        stored = r.read_object("text/layers/0/gdn/in_proj")
    qkv, z = w["text/layers/0/gdn/qkv"], w["text/layers/0/gdn/z"]
    assert isinstance(qkv, PackedWeight) and qkv.format == "q8_g32_fp16"
    assert qkv.planes[0].untyped_storage().data_ptr() == z.planes[0].untyped_storage().data_ptr()
    assert qkv.planes[0].numpy().tobytes() == stored[:qkv.planes[0].numel()]
    bank = w["text/layers/0/moe/experts/gate_up"]
    assert bank.format == "q4_g64_fp16" and bank.shape == (8, 64, 64)
    assert not isinstance(w["text/layers/0/moe/router"], PackedWeight)
