"""``ninfer generate`` and ``ninfer bench`` with ``--speculative dflash`` / ``dflash2`` on an artifact converted with
a random drafter (``ninfer-convert TARGET OUT --draft DRAFT_DIR``): the output is the plain one, and bench reports
the backend's acceptance fields (the same fields as for mtp)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.dflash import write_dflash_drafter

from tests.cli.conftest import PLAIN_ARGS

DRAFT = dict(hidden_size=256, vocab_size=6144, num_target_layers=8, target_layer_ids=[1, 3, 5], block_size=8,
             mask_token_id=6143, head_dim=32, heads=4, kv_heads=2, intermediate=256, selector_rank=16,
             selector_top_k=8)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, cli_env):
    """The default model with a random DFlash2 drafter, converted by the ``ninfer-convert`` command."""
    from ninfer.plugins import get_registry

    root = tmp_path_factory.mktemp("cli_dflash")
    folder = get_registry().default_models["qwen3_5-stdlib"].source
    write_dflash_drafter(root / "draft", seed=61, generation=2, **DRAFT)
    out = root / "m.ninfer"
    run = subprocess.run([sys.executable, "-m", "ninfer_convert.cli", str(folder), str(out), "--draft",
                          str(root / "draft"), "--quiet"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return out


def test_generate_speculative_dflash2_prints_the_plain_output(run_cli, artifact, plain_generate):
    command, *flags = PLAIN_ARGS
    args = (command, str(artifact), *flags)
    plain = plain_generate   # the default model's: the artifact's text part
    spec = run_cli(*args, "--speculative", "dflash2")
    spec3 = run_cli(*args, "--speculative", "dflash2", "--num-speculative-tokens", "3")
    for run in (plain, spec, spec3):
        assert run.returncode == 0, run.stderr
    assert len(plain.stdout) > 8 and spec.stdout == plain.stdout and spec3.stdout == plain.stdout
    wrong = run_cli(*args, "--speculative", "dflash")
    assert wrong.returncode != 0 and "use --speculative dflash2" in wrong.stderr


def test_bench_reports_the_backend_and_its_acceptance(cli_env, artifact, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", str(artifact), "--device", "cpu", "--max-context", "64",
           "--batches", "2", "--prefill-lengths", "8", "--decode-prompt-tokens", "8", "--decode-base-tokens", "2",
           "--decode-steps", "6", "--repeats", "1", "--warmup", "0", "--copy-mib", "16", "--matmul-size", "128",
           "--speculative", "dflash2", "--output", str(out)]
    run = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    spec = json.loads(out.read_text())["engine"]["speculation"]
    assert spec["backend"] == "dflash2" and spec["num_speculative_tokens"] == DRAFT["block_size"] - 1
    assert spec["verifies"] > 0 and spec["drafted_by_position"][0] == spec["verifies"]
    assert sum(spec["drafted_by_position"]) == spec["drafted"]
    assert f"speculative: dflash2, {DRAFT['block_size'] - 1} drafts per step" in run.stdout
