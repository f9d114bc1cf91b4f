"""The engine runs quantized tiny models on the CPU: scores equal those of an fp32 artifact holding the decoded
weights (the reference ops decode exactly), generation works, and the op resolution is keyed by the format."""

from __future__ import annotations

import shutil

import pytest
import torch
from ninfer import Engine
from ninfer.conversion import convert
from ninfer.ops import resolve_ops
from ninfer.ops.registry import OpError
from ninfer.plugins import get_registry
from ninfer.quant import PackedWeight, fp8_row
from ninfer.quant.groupwise import GROUPWISE
from safetensors.torch import load_file, save_file

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
FORMAT = {"q8": "q8_g32_fp16", "q4": "q4_g64_fp16", "fp8": "fp8_e4m3fn_row_bf16"}


def _decoded(name: str, w: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the converter stores for an HF tensor, decoded: rows of the last dim are encoded independently, so
    encoding each source tensor equals encoding the fused parent objects the mapping builds from them."""
    if w.dim() < 2 or "embed_tokens" in name or "conv1d" in name:
        return w
    rows = w.reshape(-1, w.shape[-1])
    if fmt == fp8_row.FORMAT:
        vals = fp8_row.decode(*fp8_row.encode(rows))
    else:
        spec = GROUPWISE[fmt]
        vals = spec.decode(*spec.encode(rows), w.shape[-1])
    return vals.reshape(w.shape).contiguous()


def _logprobs(path) -> torch.Tensor:
    with Engine.start(path, device="cpu", dtype="float32", purpose="causal_scoring") as eng:
        rep = eng.score([TEXT], logprobs=True)
    return torch.tensor([t.logprob for t in rep.texts[0].token_logprobs], dtype=torch.float64)


@pytest.mark.parametrize("kind,preset,bound", [("dense", "q4", 1.0), ("moe", "q8", 1.0), ("dense", "fp8", 1.0)])
def test_quantized_engine_matches_decoded_weights(checkpoints, tmp_path, kind, preset, bound):
    src = checkpoints[kind]
    quant, plain, decoded = tmp_path / "q.ninfer", tmp_path / "plain.ninfer", tmp_path / "decoded.ninfer"
    convert(src, quant, progress=False, quantize=preset)
    convert(src, plain, progress=False)
    folder = tmp_path / "decoded"
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: _decoded(k, v, FORMAT[preset]) for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    convert(folder, decoded, progress=False)
    lq, ld, lp = _logprobs(quant), _logprobs(decoded), _logprobs(plain)
    # the packed path computes exactly what fp32 ops compute on the decoded weights
    assert torch.allclose(lq, ld, atol=1e-4, rtol=0), (lq - ld).abs().max()
    # and stays near the unquantized model (the tiny random GDN models amplify weight error: a loose bound)
    assert float((lq - lp).abs().mean()) < bound
    with Engine.start(quant, device="cpu", dtype="float32") as eng:
        out = eng.generate("hello", max_tokens=6, temperature=0)
    assert len(out.token_ids) >= 1


def test_op_resolution_is_keyed_by_weight_format():
    reg = get_registry()
    cpu = resolve_ops(reg.ops, "cpu", torch.float32, contracts=reg.op_contracts, force="reference")
    w = torch.randn(6, 64, dtype=torch.float64)
    spec = GROUPWISE["q8_g32_fp16"]
    base, high, scales = spec.encode(w)
    packed = PackedWeight("q8_g32_fp16", (6, 64), (base, high, scales))
    x = torch.randn(3, 64)
    assert cpu.implementation("linear", "q8_g32_fp16").name == "torch_reference_dequant"
    want = x.double() @ spec.decode(base, high, scales, 64, torch.float64).T
    assert torch.allclose(cpu.linear(x, packed).double(), want, atol=1e-5)
    assert torch.equal(cpu.linear(x, w.float()), torch.nn.functional.linear(x, w.float()))   # dense still dense
    cpu.check_formats("moe_experts", ["q4_g64_fp16", "fp8_e4m3fn_row_bf16"])
    # a device without an implementation for the format: an error naming op, format and device, at check time
    gpu = resolve_ops(reg.ops, "cuda", torch.bfloat16, contracts=reg.op_contracts, force="reference")
    with pytest.raises(OpError, match="'linear'.*q8_g32_fp16.*'cuda'"):
        gpu.check_formats("linear", ["q8_g32_fp16"])
    cpu.check_formats("linear", ["nvfp4"])   # the reference ops decode every quantized format


def test_packed_row_blocks_of_one_parent_fuse(checkpoints, tmp_path):
    from ninfer.artifact import ArtifactReader, load_weights
    from ninfer.contracts.features import StartupFeatures
    from ninfer_qwen3_5.layers.fused import row_groups
    from ninfer_qwen3_5.parameters import parameter_specs

    out = tmp_path / "q.ninfer"
    convert(checkpoints["dense"], out, progress=False, quantize="mixed")
    with ArtifactReader(out) as r:
        w = load_weights(r, parameter_specs(r.directory.components["text"].config, StartupFeatures()), "cpu")
    names = [f"text/layers/0/gdn/{n}" for n in ("qkv", "z", "b", "a")]
    (group,) = row_groups([w[n] for n in names])
    assert isinstance(group.weight, PackedWeight) and group.sizes == tuple(w[n].shape[0] for n in names)
    whole = group.weight.dequantize(torch.float64)
    assert torch.equal(whole, torch.cat([w[n].dequantize(torch.float64) for n in names]))
    # different formats or parents stay apart
    assert len(row_groups([w["text/layers/0/gdn/qkv"], w["text/layers/0/gdn/out"]])) == 2
    assert len(row_groups([w["text/layers/0/mlp/gate_up"], w["text/layers/0/input_norm"][None, :]])) == 2
