"""``ninfer-convert --quantize`` and ``ninfer info`` on a quantized artifact."""

from __future__ import annotations

import json

from ninfer.artifact import ArtifactReader, summarize
from ninfer.cli.main import main as ninfer_main
from ninfer_convert.cli import main as convert_main


def test_convert_quantize_and_info(checkpoints, tmp_path, capsys):
    out = tmp_path / "q.ninfer"
    assert convert_main([str(checkpoints["moe"]), str(out), "--quantize", "mixed", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "quantized objects:" in said and "q4_g64_fp16" in said and "q6_g64_fp16" in said
    with ArtifactReader(out) as r:
        s = summarize(r)
    classes = s["parameter_formats"]
    assert classes["text/layers/*/moe/experts/gate_up"] == {"q4_g64_fp16": 4}
    assert classes["text/layers/*/moe/router"] == {"fp32": 4}
    assert classes["text/lm_head"] == {"q6_g64_fp16": 1}
    assert s["objects_by_format"]["q4_g64_fp16"]["objects"] == 8
    assert ninfer_main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "parameter formats (by class):" in text
    assert "text/layers/*/moe/experts/down: q4_g64_fp16 x4" in text
    assert "q8_g32_fp16:" in text   # by-format sizes
    assert ninfer_main(["info", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["parameter_formats"]["text/lm_head"] == {"q6_g64_fp16": 1}


def test_convert_quantize_error_exit(checkpoints, tmp_path, capsys):
    out = tmp_path / "q.ninfer"
    assert convert_main([str(checkpoints["dense"]), str(out), "--quantize", "q3", "--quiet"]) == 1
    assert "'q3' is neither a preset" in capsys.readouterr().err
    assert not out.exists()
