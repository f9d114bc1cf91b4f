"""tools/gpu_prefill_kernels_ab.py switches the prefill kernels' launch choices in process: each combination sets
the module state the ops read at every call, and leaving it restores today's defaults (the A/B itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpu_prefill_kernels_ab as ab  # noqa: E402
from ninfer.ops.triton import attention, attention_sdpa  # noqa: E402
from ninfer.ops.triton import moe as tm  # noqa: E402


def test_each_combination_sets_and_restores_the_module_state():
    today = attention._prefill_config(256, torch.bfloat16), tm.LARGE_PAIRS, tm.GROUPED_MM
    with ab.choices("old", "old"):
        assert attention._prefill_config(256, torch.bfloat16) == ab.TILES["old"]
        assert attention._prefill_config(128, torch.bfloat16)["BLOCK_N"] == 64            # narrow heads keep theirs
        assert attention._prefill_config(256, torch.float32)["BLOCK_M"] == 16     # fp32 keeps its own tile
        assert tm.LARGE_PAIRS > 1 << 40 and tm.GROUPED_MM is False
    with ab.choices("new", "grouped_mm"):
        assert attention._prefill_config(256, torch.bfloat16) == today[0]
        assert tm.LARGE_PAIRS == today[1] and tm.GROUPED_MM is True and attention_sdpa.ENABLED is False
    with ab.choices("n32", "large"):
        assert attention._prefill_config(256, torch.bfloat16) == {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8,
                                                                  "num_stages": 2}
        assert attention_sdpa.ENABLED is False
    with ab.choices("sdpa", "large"):
        assert attention_sdpa.ENABLED is True and tm.GROUPED_MM is False
    assert attention_sdpa.ENABLED is False
    with pytest.raises(RuntimeError), ab.choices("old", "large"):
        raise RuntimeError("a failed measurement")
    assert (attention._prefill_config(256, torch.bfloat16), tm.LARGE_PAIRS, tm.GROUPED_MM) == today


def test_first_tokens_are_compared_at_every_length_and_a_flip_names_its_combinations():
    runs = [{"tokens": n, "attention": a, "moe": m, "first_tokens": [(tok,)]}
            for n, a, m, tok in ((2048, "old", "old", 5), (2048, "new", "large", 5),
                                 (8192, "old", "old", 7), (8192, "new", "grouped_mm", 9))]
    seen = ab.first_tokens_by_length(runs)
    assert seen == {2048: {"[5]": ["old/old", "new/large"]},
                    8192: {"[7]": ["old/old"], "[9]": ["new/grouped_mm"]}}
    assert not all(len(v) == 1 for v in seen.values())   # the tool's agreement flag is False for these runs
