"""``ninfer serve`` is honest about readiness: the address is taken before the model loads (a port in use fails
at once, exit 2, naming it), "serving ... on URL" is printed only once the server answers, and every log line
(the access log at ``--log-level info`` included) carries a timestamp and a level."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

from serve_helpers import free_port

TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR|DEBUG) [\w.]+: ")


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = tmp_path / "no-such-model.ninfer"   # never reached: the address is checked first
        proc = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "serve", str(missing), "--host", "127.0.0.1",
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr and "--port" in proc.stderr
    assert "no-such-model" not in proc.stderr


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status


def test_ready_line_means_it_answers_and_logs_are_timestamped(artifact):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli.main", "serve", str(artifact), "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu", "--max-concurrency", "1", "--max-context", "256",
                             "--no-warmup", "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if line.startswith("[ninfer] serving "):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(180), "no ready line:\n" + "\n".join(lines)
        assert any(f"http://127.0.0.1:{port}" in line for line in lines if line.startswith("[ninfer] serving "))
        # The ready line gives the chat page's URL, and the page is there.
        assert any(line.endswith(f"chat page: http://127.0.0.1:{port}/") for line in lines
                   if line.startswith("[ninfer] serving "))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/html")
        # Once the line is out, the first request answers: no retry.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            assert r.status == 200
        # An unknown field is ignored with a warning, which must carry its level and time.
        assert _post(f"http://127.0.0.1:{port}/v1/completions",
                     {"prompt": "x", "max_tokens": 1, "made_up_field": 1}) == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        reader.join(10)
    assert proc.returncode == 0, "\n".join(lines)
    access = [line for line in lines if "uvicorn.access" in line and "GET /health" in line]
    assert access and all(TIMESTAMPED.match(line) for line in access), "\n".join(lines)
    warning = [line for line in lines if "made_up_field" in line]
    assert warning and all(TIMESTAMPED.match(line) and " WARNING " in line for line in warning), "\n".join(lines)


def test_no_access_log_above_info():
    from ninfer_serve.server import log_config

    config = log_config("warning")
    assert config["loggers"]["uvicorn.access"]["level"] == "WARNING"
    assert config["disable_existing_loggers"] is False   # the engine's loggers keep working
