"""The Qwen3.5 vision tower: input pixel rows of one or more media -> their merged embeddings (text width).

Per medium of patch grid ``(t, h, w)`` (index tables: :mod:`.grid`), over its ``t*h*w`` rows of
``C * Tp * P * P`` values (one 3-D patch each, channels-major, as the Conv3d kernel reads it):

    x = linear_bias(rows, patch_embed)              # the Conv3d whose kernel equals its stride
    x += bilinear(pos_embed)                        # the learned grid resampled to (h, w), fp32 then x.dtype
    per block:  x += proj(segment_attention(rope(q), rope(k), v))   with q | k | v = qkv(layer_norm(x))
                x += fc2(gelu_tanh(fc1(layer_norm(x))))
    merger:     y = fc2(gelu_erf(fc1(layer_norm(x) viewed [rows / m^2, m^2 * hidden])))

Attention is bidirectional within one frame (segments of ``h*w`` rows); every layer norm has eps 1e-6. The
``m x m`` patches of a merge block are consecutive rows (merge-block order), so the merger's view gathers
exactly one block per output row. The output rows come in input order: medium by medium, frame by frame, each
frame's ``h*w / m^2`` embeddings in block row-major order (the order of the placeholder tokens they replace).

Several media run in one call (a batch across requests): their rows are concatenated; segments keep them apart.

Weights: every ``vision/*`` parameter (:mod:`.parameters`) as a float tensor, cast once to the run dtype at
construction like the text model's (quantized vision weights are refused, naming the parameter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from ninfer.contracts.program import ProgramError
from ninfer.quant import PackedWeight

from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.grid import Grid, check_grid, position_taps, rotary_tables, segment_bounds
from ninfer_qwen3_5.vision.parameters import vision_shapes

_EPS = 1e-6


class VisionTower:
    def __init__(self, cfg: VisionConfig, weights: Mapping[str, torch.Tensor], ops, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg, self.ops, self.device, self.dtype = cfg, ops, torch.device(device), dtype
        w: dict[str, torch.Tensor] = {}
        for name, shape in vision_shapes(cfg).items():
            t = weights.get(name)
            if t is None:
                raise ProgramError(f"the vision tower's weights lack parameter {name!r}")
            if isinstance(t, PackedWeight) or not t.dtype.is_floating_point:
                kind = t.format if isinstance(t, PackedWeight) else t.dtype
                raise ProgramError(f"vision parameter {name!r} is {kind}; the tower runs float weights only")
            if tuple(t.shape) != shape:
                raise ProgramError(f"vision parameter {name!r} has shape {tuple(t.shape)}, expected {shape}")
            w[name] = t if t.dtype == dtype else t.to(dtype)
        self.patch_weight = w["vision/patch_embed/proj/weight"].reshape(cfg.hidden_size, cfg.patch_values)
        self.patch_bias = w["vision/patch_embed/proj/bias"]
        self.pos_table = w["vision/pos_embed/weight"]
        self.blocks = [{k[len(f"vision/blocks/{i}/"):]: v for k, v in w.items() if k.startswith(f"vision/blocks/{i}/")}
                       for i in range(cfg.depth)]
        self.merger = {k[len("vision/merger/"):]: v for k, v in w.items() if k.startswith("vision/merger/")}
        self.scale = cfg.head_dim ** -0.5

    def output_rows(self, grids: Sequence[Grid]) -> int:
        return sum(t * h * w for t, h, w in grids) // self.cfg.merge_unit

    def encode(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Merged embeddings ``[N / m^2, out_hidden]`` (run dtype, on the tower's device) of ``pixels[N, C*Tp*P*P]``,
        the rows of the media whose patch grids are ``grids``, concatenated in that order."""
        cfg, ops = self.cfg, self.ops
        checked = [check_grid(g, cfg.spatial_merge_size, f"grid {i}") for i, g in enumerate(grids)]
        rows = sum(t * h * w for t, h, w in checked)
        if pixels.dim() != 2 or tuple(pixels.shape) != (rows, cfg.patch_values):
            raise ProgramError(f"vision input of shape {tuple(pixels.shape)} does not fit grids {checked}: expected "
                               f"[{rows}, {cfg.patch_values}] (t*h*w rows of C*Tp*P*P values)")
        if not pixels.dtype.is_floating_point:
            raise ProgramError(f"vision input must be floating point, got {pixels.dtype}")
        dev = self.device
        x = ops.linear_bias(pixels.to(dev, self.dtype), self.patch_weight, self.patch_bias)
        idx, wts = position_taps(checked, cfg.spatial_merge_size, cfg.grid_side)
        pos = (self.pos_table.float()[idx.to(dev)] * wts.to(dev)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = (t.to(dev) for t in rotary_tables(checked, cfg.spatial_merge_size, cfg.head_dim,
                                                     cfg.rope_theta))
        cu = torch.tensor(segment_bounds(checked), dtype=torch.int32, device=dev)
        n, heads, d = rows, cfg.num_heads, cfg.head_dim
        for b in self.blocks:
            h = ops.layer_norm(x, b["norm1/weight"], b["norm1/bias"], _EPS)
            qkv = ops.linear_bias(h, b["attn/qkv/weight"], b["attn/qkv/bias"]).view(n, 3, heads, d)
            q = ops.rope(qkv[:, 0], cos, sin)
            k = ops.rope(qkv[:, 1], cos, sin)
            o = ops.segment_attention(q, k, qkv[:, 2], cu, self.scale)
            x = x + ops.linear_bias(o.reshape(n, heads * d), b["attn/proj/weight"], b["attn/proj/bias"])
            h = ops.layer_norm(x, b["norm2/weight"], b["norm2/bias"], _EPS)
            h = ops.gelu_tanh(ops.linear_bias(h, b["mlp/linear_fc1/weight"], b["mlp/linear_fc1/bias"]))
            x = x + ops.linear_bias(h, b["mlp/linear_fc2/weight"], b["mlp/linear_fc2/bias"])
        m = self.merger
        y = ops.layer_norm(x, m["norm/weight"], m["norm/bias"], _EPS).reshape(-1, cfg.merge_unit * cfg.hidden_size)
        y = ops.gelu_erf(ops.linear_bias(y, m["linear_fc1/weight"], m["linear_fc1/bias"]))
        return ops.linear_bias(y, m["linear_fc2/weight"], m["linear_fc2/bias"])
