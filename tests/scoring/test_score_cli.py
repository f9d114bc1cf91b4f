"""``ninfer score``: input files, the report, bad input, and the default model end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ninfer.cli.main import main

from .conftest import MAX_POSITIONS, start_scorer

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "default_model_passage.json").read_text())


@pytest.fixture
def score(scoring_model, tmp_path, capsys):
    """``score(input_path, *flags) -> (rc, report or None, stdout, stderr)`` in-process on the tiny model."""
    artifact = scoring_model("dense").artifact

    def run(path: Path, *flags: str):
        out = tmp_path / "report.json"
        if out.exists():
            out.unlink()
        rc = main(["score", str(artifact), "--input", str(path), "--output", str(out), "--device", "cpu",
                   "--dtype", "float32", *flags])
        captured = capsys.readouterr()
        return rc, (json.loads(out.read_text()) if out.exists() else None), captured.out, captured.err

    return run


def test_txt_is_one_text_and_matches_the_api(score, scoring_model, tmp_path):
    text = "while True:\n    line = input()\n    if not line:\n        break\n"
    path = tmp_path / "code.txt"
    path.write_text(text, encoding="utf-8")
    rc, report, out, err = score(path, "--context", "16", "--stride", "8")
    assert rc == 0, err
    assert report["settings"]["context"] == 16 and report["settings"]["stride"] == 8
    assert report["input"] == {"path": str(path), "texts": 1}
    (t,) = report["texts"]
    assert t["id"] == "code.txt" and "token_logprobs" not in t
    with start_scorer(scoring_model("dense").artifact, prefill_chunk_size=512) as engine:
        api = engine.score(text, context=16, stride=8).texts[0]
    assert (t["scored_tokens"], t["nll"]) == (api.scored_tokens, api.nll)
    assert report["overall"]["perplexity"] == api.perplexity
    assert f"perplexity {api.perplexity:.4f}" in out and "scoring" in err  # summary; progress bar on stderr


def test_jsonl_texts_ids_and_logprobs(score, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "first text", "id": "a"}\n\n{"text": "second", "id": 7}\n{"text": "x"}\n',
                    encoding="utf-8")
    rc, report, _, err = score(path, "--context", "8", "--stride", "8", "--logprobs", "--top-logprobs", "2")
    assert rc == 0, err
    assert [t["id"] for t in report["texts"]] == ["a", "7", None]
    assert [t["scored_tokens"] for t in report["texts"]] == [9, 5, 0]
    assert all(len(t["token_logprobs"]) == t["scored_tokens"] for t in report["texts"])
    assert report["texts"][2]["perplexity"] is None
    assert len(report["texts"][0]["token_logprobs"][0]["top"]) == 2


def test_empty_txt_scores_nothing(score, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    rc, report, out, err = score(path)
    assert rc == 0, err
    assert report["overall"]["scored_tokens"] == 0 and report["overall"]["perplexity"] is None
    assert "perplexity null" in out


@pytest.mark.parametrize("name, data, match", [
    ("bad.txt", b"caf\xc3\xa9 ok\n\xff\xfe bad", "bad.txt: byte offset 9: not valid UTF-8"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "\xc3("}\n', "bad.jsonl: line 2, byte offset 10: not valid UTF-8"),
    ("list.jsonl", b'{"text": "ok"}\n[1, 2]\n', "line 2: expected a JSON object with a \"text\" string"),
    ("notext.jsonl", b'{"id": "a"}\n', "line 1: expected a JSON object"),
    ("number.jsonl", b'{"text": 5}\n', "line 1: expected a JSON object"),
    ("badid.jsonl", b'{"text": "a", "id": [1]}\n', "line 1: \"id\" must be"),
    ("broken.jsonl", b'{"text": "a"\n', "line 1: not JSON"),
    ("surrogate.jsonl", b'{"text": "ok"}\n{"text": "ab\\ud800"}\n',
     'line 2: "text" has a lone UTF-16 surrogate U+D800 at character 2'),
    ("blank.jsonl", b"\n  \n", "no texts"),
    ("input.csv", b"a,b\n", "must be a .txt or a .jsonl"),
])
def test_bad_input_files(score, tmp_path, name, data, match):
    path = tmp_path / name
    path.write_bytes(data)
    rc, report, _, err = score(path)
    assert rc == 2 and report is None
    assert "ninfer score: error:" in err and match in err


@pytest.mark.parametrize("flags, match", [
    (("--context", "8", "--stride", "9"), "stride=9: it exceeds context=8"),
    (("--context", "0"), "context=0"),
    (("--context", str(MAX_POSITIONS + 1)), f"the model has {MAX_POSITIONS} positions"),
    (("--top-logprobs", "2"), "top_logprobs needs logprobs=True"),
])
def test_bad_options(score, tmp_path, flags, match):
    path = tmp_path / "t.txt"
    path.write_text("some text to score", encoding="utf-8")
    rc, report, _, err = score(path, *flags)
    assert rc == 2 and report is None and match in err


def test_missing_input_file(score, tmp_path):
    rc, _, _, err = score(tmp_path / "absent.txt")
    assert rc == 2 and "cannot read" in err


def test_default_model_memorised_passage_as_a_user_runs_it(tmp_path):
    """A subprocess on the embedded default model: a passage of its training corpus that it reproduces
    greedily must score a low perplexity (a random text scores ~vocab, 6144)."""
    env = dict(os.environ, NINFER_CACHE_DIR=str(tmp_path / "cache"))
    path = tmp_path / "passage.txt"
    path.write_text(FIXTURE["prompt_text"] + FIXTURE["continuation_text"], encoding="utf-8")
    out = tmp_path / "report.json"
    help_ = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "--help"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert "score" in help_.stdout
    proc = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "score", "--input", str(path), "--output",
                           str(out), "--context", "64", "--stride", "32", "--device", "cpu", "--dtype", "float32",
                           "--logprobs"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    (t,) = report["texts"]
    assert t["scored_tokens"] == t["input_tokens"] - 1 >= len(FIXTURE["prompt_token_ids"])
    assert report["artifact"]["architecture"] == "Qwen3_5ForCausalLM"
    assert t["perplexity"] < 10, t["perplexity"]
    # The memorised continuation: every one of its tokens is the model's most likely next token,
    # so its log-probabilities are far above a uniform guess (log 1/6144 = -8.7).
    cont = t["token_logprobs"][-len(FIXTURE["continuation_token_ids"]):]
    assert [e["token"] for e in cont] == FIXTURE["continuation_token_ids"]
    assert sum(e["logprob"] for e in cont) / len(cont) > -1.0


def test_an_output_that_cannot_be_written_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """--output in a missing folder, or a folder itself: refused before the model is resolved or loaded, so a
    long run's results are never lost at its end."""
    from ninfer.cli import score_cmd

    def no_model(*_a, **_k):
        raise AssertionError("the model was resolved before --output was checked")

    monkeypatch.setattr("ninfer.model_source.resolve_model", no_model)
    text = tmp_path / "t.txt"
    text.write_text("some text to score")
    for out, why in ((tmp_path / "missing" / "r.json", "does not exist"), (tmp_path, "it is a folder")):
        assert main(["score", "--input", str(text), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the report to {out}: " in err and why in err, err
    assert score_cmd._check_output(tmp_path / "r.json") is None
