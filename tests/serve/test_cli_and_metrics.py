"""``ninfer serve`` wiring (a plugin command, no HTTP stack until it runs, clear errors), the warm-up's
guarantees, and /metrics."""

from __future__ import annotations

import os
import subprocess
import sys

from ninfer_serve.warmup import warm_up
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL_ID, chat, client_for, scripted_engine, sse_json, wait_idle


def test_serve_is_a_plugin_command_that_imports_no_http_stack_until_it_runs():
    code = ("import sys; from ninfer.cli.main import build_parser; p = build_parser(); "
            "a = p.parse_args(['serve', '--port', '9', '--model-id', 'm']); "
            "print('ninfer_serve.plugin' in sys.modules, "
            "any(m in sys.modules for m in ('litestar', 'uvicorn', 'ninfer_serve.app')), a.port, a.model_id, a.host)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "9", "m", "127.0.0.1"], out.stderr


def test_serve_left_out_of_the_plugins_names_the_package():
    code = "import sys; from ninfer.cli.main import main; sys.exit(main(['serve', '--port', '9']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, NINFER_PLUGINS="qwen3_5"))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("ninfer serve: error: 'ninfer serve' comes from the ninfer-serve distribution")
    assert "NINFER_PLUGINS='qwen3_5'" in out.stderr


def test_bad_flags_are_clear_errors(capsys):
    from ninfer.cli.main import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in 1..65535" in capsys.readouterr().err
    assert main(["serve", "--api-key", "  "]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    assert main(["serve", "--keepalive", "0"]) == 2
    assert "--keepalive must be > 0" in capsys.readouterr().err


def test_warmup_leaves_nothing_behind(engine):
    eng = scripted_engine(engine.frontend)
    try:
        took = warm_up(eng)
        s = eng.stats()
        assert took > 0 and s.submitted == 1 and s.finished == 1
        assert (s.outstanding, s.running, s.queue_depth, s.pages_used, s.state_slots_used) == (0, 0, 0, 0, 0)
        with client_for(eng) as c:  # a server started afterwards counts no warm-up request
            assert "ninfer_requests_total{" not in c.get("/metrics").text
    finally:
        eng.close()


def test_metrics_exposition(scripted):
    wait_idle(scripted)
    with client_for(scripted) as c:
        usages = []
        for req in (chat("SCRIPT:one two three"), chat("SCRIPT:four", stream=True,
                                                       stream_options={"include_usage": True}),
                    chat("filler", max_tokens=7, ignore_eos=True)):
            r = c.post("/v1/chat/completions", json=req)
            assert r.status_code == 200
            usages.append(sse_json(r.text)[-1]["usage"] if req.get("stream") else r.json()["usage"])
        assert c.post("/v1/chat/completions", json={**chat("x"), "model": "zzz"}).status_code == 404
        assert c.post("/v1/messages", json={"model": MODEL_ID}).status_code == 400
        # A response can reach the client before the worker's next step publishes the stats the gauges read.
        wait_idle(scripted)
        text = c.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}

    def v(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert v("ninfer_requests_total", endpoint="/v1/chat/completions", outcome="stop") == 2
    assert v("ninfer_requests_total", endpoint="/v1/chat/completions", outcome="length") == 1
    assert v("ninfer_requests_total", endpoint="/v1/chat/completions", outcome="invalid") == 1
    assert v("ninfer_requests_total", endpoint="/v1/messages", outcome="invalid") == 1
    assert v("ninfer_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert v("ninfer_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert v("ninfer_time_to_first_token_seconds_count") == 3
    assert v("ninfer_inter_token_latency_seconds_count") == sum(u["completion_tokens"] for u in usages) - 3
    assert v("ninfer_request_duration_seconds_count") == 3
    for gauge, want in (("ninfer_queue_depth", 0), ("ninfer_requests_running", 0), ("ninfer_engine_up", 1),
                        ("ninfer_state_slots_total", 2), ("ninfer_kv_pages_used", 0), ("ninfer_kv_usage_ratio", 0),
                        ("ninfer_state_usage_ratio", 0)):
        assert v(gauge) == want, gauge
    assert v("ninfer_kv_pages_total") > 0 and "ninfer_preemptions_total" in text
    assert v("ninfer_chunks_total") >= 1 and v("ninfer_max_step_chunks") >= 1  # the prompts were prefilled
    for name in ("ninfer_spec_drafted_tokens_total", "ninfer_spec_accepted_tokens_total",
                 "ninfer_spec_verify_steps_total"):
        assert v(name) == 0, name   # exported, and zero without speculation
