"""ninfer_serve.process: waiting for a child server's /health, and the two ways that wait fails."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ninfer_serve.process import ServerStartError, free_port, wait_until_healthy

# A minimal server that answers /health with 200 (and everything else with 404).
HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_returns_once_health_answers():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(port)])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, timeout=30)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_an_exited_process_or_a_timeout_is_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerStartError, match="exited with code 3"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout=30)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ServerStartError, match="did not answer 200 within 0.5 s"):
            wait_until_healthy(f"http://127.0.0.1:{free_port()}", sleeper, timeout=0.5)
    finally:
        sleeper.kill()
        sleeper.wait()
