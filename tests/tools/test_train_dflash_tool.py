"""tools/train_dflash.py on the CPU, tiny: a smoke corpus of two stdlib files in the default model's tokenizer, a
few training steps of a one-layer DFlash and DFlash2 drafter for the default model, then the written z-lab folder
converts with the default model (``--draft``) and the engine's block logits (``ninfer_qwen3_5.dflash``) equal the
training model's for the same context and anchor, fed the same target features (fp32, 1e-4) and fed the engine's
own target forward; the DFlash2 selector picks the same greedy paths in both; the report holds the recipe, the
losses and the held-out acceptance. Two runs with one seed train bit-identical weights.

The anchor sampler and the assistant-turn mask are checked on small hand-made cases.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import dflash_corpus  # noqa: E402
import train_dflash  # noqa: E402

TINY = ["--device", "cpu", "--batch-size", "2", "--seq-len", "64", "--anchors-per-window", "4", "--block-size", "4",
        "--layers", "1", "--intermediate", "128", "--selector-rank", "8", "--selector-top-k", "4",
        "--train-windows", "8", "--eval-max-windows", "2", "--eval-anchor-stride", "24", "--eval-batch-size", "2",
        "--log-every", "1", "--curve-windows", "2", "--eval-every", "4"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dflash_work")
    info = train_dflash.main(["prepare", "--work", str(folder), "--smoke-files", "2"])
    assert info["tokenizer"] == "the target's"
    return folder


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_smoke_run_converts_and_matches_the_engine(work, tmp_path, kind):
    out = tmp_path / kind
    report = train_dflash.main(["train", "--kind", kind, "--work", str(work), "--out", str(out), "--max-steps", "8",
                                "--check", "--check-tokens", "48", *TINY])
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "training_report.json"}
    assert json.loads((out / "training_report.json").read_text()) == json.loads(json.dumps(report))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"]
    dc = cfg["dflash_config"]
    assert dc["target_layer_ids"] == [1, 3, 5, 6] and dc["mask_token_id"] == 6135 and dc["block_size"] == 4
    assert cfg["hidden_size"] == 256 and cfg["num_target_layers"] == 8
    assert report["training"]["steps"] == 8 and report["training"]["stopped_by"] == "max_steps"
    assert report["recipe"]["loss_decay_gamma"] == 2.0
    losses = [row["loss"] for row in report["losses"]]
    assert len(losses) == 8 and all(np.isfinite(losses)) and min(losses[4:]) < losses[0]
    assert [row["step"] for row in report["losses"] if "heldout_ce" in row] == [0, 4, 7]
    p = report["parity"]
    assert p["drafter_max_abs_logit_error"] < 1e-4 and p["drafter_same_argmax"]
    assert p["engine_max_abs_logit_error"] < 1e-3 and p["engine_same_argmax"]
    if kind == "dflash2":
        assert p["selector_projection_max_abs_error"] < 1e-5 and p["selector_same_paths"]
    for name in ("heldout_source", "heldout_chat"):
        ev = report["evaluation"][name]
        assert ev["blocks"] == sum(ev["accepted_histogram"]) > 0 and len(ev["accepted_histogram"]) == 4
        assert 0.0 <= ev["mean_accepted_drafts"] <= 3.0 and 0.0 <= ev["mtp_one_draft_acceptance"] <= 1.0


def test_a_run_is_deterministic(work, tmp_path):
    digests = [train_dflash.main(["train", "--kind", "dflash2", "--work", str(work), "--out", str(tmp_path / str(i)),
                                  "--max-steps", "3", "--skip-eval", *TINY])["training"]["weights_sha256_fp32"] for i in range(2)]
    assert digests[0] == digests[1]
    assert (tmp_path / "0" / "model.safetensors").read_bytes() == (tmp_path / "1" / "model.safetensors").read_bytes()


def test_anchors_are_distinct_allowed_positions():
    gen = torch.Generator().manual_seed(5)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, :12] = False          # row 1: positions 12..16 only (block 4 ends inside the window)
    valid[2] = False
    valid[2, 5] = True             # row 2: one allowed position
    anchors, keep = dflash_corpus.sample_anchors(gen, valid, 6, 4)
    assert anchors.shape == keep.shape == (3, 6)
    row0 = anchors[0].tolist()
    assert keep[0].all() and row0 == sorted(set(row0)) and 1 <= row0[0] and row0[-1] <= 16
    assert keep[1].sum() == 5 and sorted(anchors[1][keep[1]].tolist()) == [12, 13, 14, 15, 16]
    assert keep[2].sum() == 1 and anchors[2][keep[2]].tolist() == [5]


def test_the_assistant_mask_covers_replies_through_im_end():
    S, E, A, U = 1, 2, 3, 4       # <|im_start|>, <|im_end|>, "assistant", "user"
    stream = np.array([S, U, 9, 9, E, S, A, 7, 8, E, 5, S, A, 6], dtype=np.uint16)
    mask = dflash_corpus.assistant_mask(stream, S, E, A)
    assert np.nonzero(mask)[0].tolist() == [7, 8, 9, 13]
