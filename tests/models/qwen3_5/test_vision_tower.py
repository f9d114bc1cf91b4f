"""The vision tower alone against transformers' ``model.visual`` (fp32, CPU): converted weights, pixel rows and
grids in, merged embeddings out, for odd grids, several media in one call, and a video of several frames.

Tolerance: both sides compute the same fp32 math (ours through the op references) and differ in summation order
only; |ours - hf| <= 1e-4 * max|hf| (the embeddings are O(1)). A wrong interpolation, merge order, rotary layout
or segment boundary moves them by O(1) (the last test checks one such mutation is caught).
"""

from __future__ import annotations

import pytest
import torch
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.tower import VisionTower

from .vision_harness import pixels

GRIDS = [
    [(1, 6, 10)],
    [(1, 4, 4)],
    [(1, 2, 2)],
    [(1, 10, 6), (1, 4, 4), (1, 2, 8)],      # several images in one call
    [(3, 4, 6)],                             # a video: three temporal patches, attention per frame
    [(1, 6, 4), (2, 2, 4)],                  # an image and a video together
]


def _tower(case):
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    return VisionTower(VisionConfig.from_compact(case.config["vision_config"]), case.weights, ops,
                       torch.device("cpu"), torch.float32)


def _hf(case, rows, grids):
    with torch.no_grad():
        return case.hf.model.visual(rows, grid_thw=torch.tensor(grids)).pooler_output


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("grids", GRIDS, ids=lambda g: "+".join("x".join(map(str, x)) for x in g))
def test_tower_matches_transformers_visual(vision_case, kind, grids):
    case = vision_case(kind)
    rows = torch.cat([pixels(g, seed=i) for i, g in enumerate(grids)])
    ours = _tower(case).encode(rows, grids)
    ref = _hf(case, rows, grids)
    assert ours.shape == ref.shape == (sum(t * h * w for t, h, w in grids) // 4, 64)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{kind} {grids}: max err {err:.2e}"
    assert ref.std() > 0.1   # not degenerate


def test_media_in_one_call_equal_each_alone(vision_case):
    """Batching across requests changes nothing: segments keep media apart."""
    tower = _tower(vision_case("dense"))
    grids = [(1, 6, 10), (2, 4, 4)]
    parts = [pixels(g, seed=i) for i, g in enumerate(grids)]
    together = tower.encode(torch.cat(parts), grids)
    alone = torch.cat([tower.encode(p, [g]) for p, g in zip(parts, grids, strict=True)])
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)


def test_a_transposed_grid_is_caught(vision_case):
    """Guards the oracle's power: the same rows read with h and w swapped give other embeddings."""
    case = vision_case("dense")
    rows = pixels((1, 6, 10), seed=3)
    ref = _hf(case, rows, [(1, 6, 10)])
    swapped = _tower(case).encode(rows, [(1, 10, 6)])
    assert (swapped - ref).abs().max() > 0.05 * ref.abs().max()


def test_inputs_that_do_not_fit_their_grids_are_refused(vision_case):
    from ninfer.contracts.program import ProgramError

    tower = _tower(vision_case("dense"))
    with pytest.raises(ProgramError, match=r"expected \[24, 96\]"):
        tower.encode(pixels((1, 4, 4), seed=0), [(1, 4, 6)])
    with pytest.raises(ValueError, match="multiples of the spatial merge size"):
        tower.encode(torch.zeros(15, 96), [(1, 3, 5)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_profile_counts_the_tower_and_the_rope_delta_exactly(vision_case, kind, dtype):
    from ninfer.contracts.features import StartupFeatures
    from ninfer.testing import build_program
    from ninfer.testing.profiles import assert_profile_exact

    case = vision_case(kind)
    built = build_program(case.artifact, dtype=dtype, features=StartupFeatures(vision=True))
    assert_profile_exact(built)
    text = build_program(case.artifact, dtype=dtype)
    tower = sum(t.numel() * dtype.itemsize for n, t in built.weights.items() if n.startswith("vision/"))
    assert built.profile.weight_bytes == text.profile.weight_bytes + tower
    assert built.profile.state_bytes_per_sequence > text.profile.state_bytes_per_sequence   # the rope delta
