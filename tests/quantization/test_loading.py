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
from ninfer.quant import PackedWeight
from ninfer.quant.groupwise import GROUPWISE
from ninfer_qwen3_5.parameters import parameter_specs

E, N, K = 4, 8, 64


def _bank_artifact(path, parts):
    """A q4 bank [E, N, K] bound whole as ``bank`` and by ``parts`` (name -> (begin, end, shape))."""
    spec = GROUPWISE["q4_g64_fp16"]
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(5))
    base, high, scales = spec.encode(w.reshape(-1, K))
    high_off, scale_off, total, _ = spec.plane_offsets(E * N, K)
    data = bytearray(total)
    data[:base.numel()] = base.numpy().tobytes()
    data[scale_off:] = scales.view(torch.uint8).numpy().tobytes()
    wr = ArtifactWriter(path)
    wr.add_component("text", {"architectures": ["Test"]})
    wr.declare_tensor("bank", (E, N, K), "q4_g64_fp16")
    wr.bind("bank", "bank")
    for name, (b, e, _) in parts.items():
        wr.bind_parts(name, [("bank", b, e)])
    wr.begin_payload()
    wr.write("bank", bytes(data))
    wr.finish()
    return bytes(data)


def test_expert_slice_of_a_quantized_bank(tmp_path):
    path = tmp_path / "bank.ninfer"
    stored = _bank_artifact(path, {"expert2": (2 * N * K, 3 * N * K, (N, K)),
                                   "rows3to6": (3 * K, 6 * K, (3, K))})
    with ArtifactReader(path) as r:
        specs = [ParameterSpec("bank", (E, N, K)), ParameterSpec("expert2", (N, K)), ParameterSpec("rows3to6", (3, K))]
        bound = {b.name: b for b in bind(r, specs).parameters}
        assert all(b.quantized and b.format == "q4_g64_fp16" and b.is_view for b in bound.values())
        w = load_weights(r, specs, "cpu")
    bank, e2, rows = w["bank"], w["expert2"], w["rows3to6"]
    assert isinstance(e2, PackedWeight) and e2.shape == (N, K)
    storage = bank.planes[0].untyped_storage().data_ptr()
    for pw in (e2, rows):
        assert all(p.untyped_storage().data_ptr() == storage for p in pw.planes)   # views of one parent read
    # the planes are the stored bytes, not decoded values
    assert bank.planes[0].dtype == torch.uint8 and bank.planes[2].dtype == torch.float16
    assert bytes(bank.planes[0].numpy().tobytes()) == stored[:bank.planes[0].numel()]
    full = bank.dequantize(torch.float64)
    assert torch.equal(e2.dequantize(torch.float64), full[2])
    assert torch.equal(bank[2].dequantize(torch.float64), full[2])
    assert torch.equal(rows.dequantize(torch.float64), full.reshape(-1, K)[3:6])


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
