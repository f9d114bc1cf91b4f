"""Security settings of the server: the API key on every route (``/metrics`` included, ``/health`` open) compared in
constant time, request header and body size limits, and the refusal to listen beyond loopback without a key.

The app-level checks run on the scripted engine through litestar's TestClient; the limits that only the real
HTTP parser enforces (a request head past its buffer, a chunked body) and the start-up refusal run ``ninfer serve``
itself."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest
from ninfer_serve import Gateway, ServeConfig, create_app
from ninfer_serve.app import supported_endpoints
from ninfer_serve.config import parser_head_limit
from ninfer_serve.listen import is_loopback
from serve_helpers import MODEL_ID, client_for, start_server_process
from test_errors import anthropic_error, openai_error

KEY = "s3cret-key"
HANG_GUARD_S = 300  # only stops a hung server from hanging the suite; nothing here is a speed requirement


def _routes(engine) -> list[tuple[str, str]]:
    """``(method, path)`` of every route the app serves, path parameters filled in."""
    app = create_app(Gateway(engine, ServeConfig(model_id=MODEL_ID)))
    out = []
    for entry in supported_endpoints(app):
        method, path = entry.split(" ", 1)
        out.append((method, path.replace("{model_id}", MODEL_ID)))
    assert ("GET", "/metrics") in out and ("GET", "/health") in out and len(out) >= 10
    return out


def test_every_route_but_health_needs_the_key(scripted):
    """Enumerated from the app itself, so a route added later is covered without editing this test. The chat
    page's exact paths are open too (test_chat_page covers them); its file route with any other name is not."""
    with client_for(scripted, api_key=KEY) as c:
        for method, path in _routes(scripted):
            if path in ("/health", "/"):
                assert c.request(method, path).status_code == 200
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY + "x"},
                            {"Authorization": f"Basic {KEY}"}):
                r = c.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
                assert c.request(method, path, headers=headers, json={}).status_code != 401, (method, path)
        # Paths no route serves are refused as well: without the key nothing tells what exists.
        assert c.get("/no/such/path").status_code == 401
        assert c.get("/no/such/path", headers={"x-api-key": KEY}).status_code == 404


def test_metrics_is_behind_the_key(scripted):
    with client_for(scripted, api_key=KEY) as c:
        assert "missing API key" in openai_error(c.get("/metrics"), 401)["message"]
        r = c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and "ninfer_engine_up" in r.text


def test_keys_are_compared_in_constant_time(scripted, monkeypatch):
    """Every check goes through hmac.compare_digest with the configured key (a plain == would return at the
    first differing byte)."""
    import ninfer_serve.auth as auth

    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    with client_for(scripted, api_key=KEY) as c:
        assert c.get("/v1/models", headers={"x-api-key": "guess"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert calls == [(b"guess", KEY.encode()), (KEY.encode(), KEY.encode())]


def test_oversized_headers_get_431_naming_the_limit(scripted):
    with client_for(scripted, api_key=KEY, max_header_bytes=1024) as c:
        fits = {"x-api-key": KEY, "x-pad": "a" * 600}
        assert c.get("/v1/models", headers=fits).status_code == 200
        big = {"x-api-key": KEY, "x-pad": "a" * 1100}
        err = openai_error(c.get("/v1/models", headers=big), 431)
        assert "limit of 1 KiB (--max-header-kib)" in err["message"] and err["status_type"] == \
            "RequestHeaderFieldsTooLargeError"
        anthropic_error(c.post("/v1/messages", json={}, headers=big), 431, "request_too_large")
        # Refused before the key is looked at: no key needed to be told, and no work done for a keyless giant.
        openai_error(c.get("/v1/models", headers={"x-pad": "a" * 1100}), 431)
        # Many small headers count together.
        many = {f"x-h{i}": "v" * 40 for i in range(30)}
        openai_error(c.get("/health", headers=many), 431)


def test_oversized_body_gets_413_naming_the_limit(scripted):
    with client_for(scripted, api_key=KEY, max_body_bytes=2048) as c:
        headers = {"x-api-key": KEY, "content-type": "application/json"}
        err = openai_error(c.post("/v1/chat/completions", content=b" " * 3000, headers=headers), 413)
        assert "larger than this server's limit of" in err["message"] and "--max-body-mib" in err["message"]
        anthropic_error(c.post("/v1/messages", content=b" " * 3000, headers=headers), 413, "request_too_large")
        ok = c.post("/tokenize", json={"model": MODEL_ID, "prompt": "x" * 1500}, headers=headers)
        assert ok.status_code == 200, ok.text


# -- binding ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("127.0.1.1", True),
                                            ("::1", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                            ("::", False), ("", False), ("10.1.2.3", False),
                                            ("no-such-host.invalid", False)])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def _own_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent; only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if is_loopback(address) else address


def test_serving_beyond_loopback_without_a_key_is_refused(monkeypatch, capsys):
    from ninfer.cli.main import main
    from ninfer_serve.process import free_port

    monkeypatch.delenv("NINFER_API_KEY", raising=False)
    hosts = ["0.0.0.0"] + [a for a in (_own_address(),) if a]
    for host in hosts:
        assert main(["serve", "--host", host, "--port", str(free_port()), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"--host {host} is reachable from other machines" in err and "--allow-unauthenticated" in err
        assert "--api-key" in err and "converting" not in err and "loaded" not in err  # refused before loading


def test_a_bad_header_limit_is_a_clear_error(capsys):
    from ninfer.cli.main import main

    assert main(["serve", "--max-header-kib", "0"]) == 2
    assert "--max-header-kib must be > 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def open_server(artifact):
    """``ninfer serve`` on every interface without a key (told so), with small limits: (base URL, process, what it
    printed up to its ``serving`` line)."""
    base, proc = start_server_process(artifact, "--host", "0.0.0.0", "--allow-unauthenticated", "--device", "cpu",
                                      "--max-context", "256", "--max-concurrency", "1", "--no-warmup",
                                      "--max-body-mib", "0.0625", "--max-header-kib", "2", "--log-level",
                                      "warning", timeout=HANG_GUARD_S)
    printed = []
    while not printed or "serving" not in printed[-1]:  # printed before /health answered: already in the pipe
        line = proc.stdout.readline()
        assert line, f"the server ended its output early: {printed}"
        printed.append(line)
    yield base, proc, printed
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0


def test_allow_unauthenticated_starts_and_says_so(open_server):
    base, _, printed = open_server
    assert any("warning: serving without an API key on 0.0.0.0 (--allow-unauthenticated)" in line
               for line in printed), printed
    assert httpx.get(f"{base}/v1/models", timeout=HANG_GUARD_S).status_code == 200


def _raw_request(base: str, head: bytes) -> bytes:
    """Send a raw request head; what the server answers before it closes."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as s:
        try:
            s.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may refuse and close while the head is still being sent
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def test_header_limits_on_the_real_server(open_server):
    """Through uvicorn's parser: a head over the limit gets the app's 431; a head that keeps coming past the
    parser's buffer is refused with a 400 and the connection closed, without waiting for its end."""
    base, _, _ = open_server
    r = httpx.get(f"{base}/v1/models", headers={"x-pad": "a" * 3000}, timeout=HANG_GUARD_S)
    assert r.status_code == 431 and "limit of 2 KiB (--max-header-kib)" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/models", headers={"x-pad": "a" * 1000}, timeout=HANG_GUARD_S).status_code == 200
    huge = parser_head_limit(2048) + 1024
    reply = _raw_request(base, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * huge)  # no end
    assert reply.startswith(b"HTTP/1.1 400 ") and b"connection: close" in reply.lower(), reply[:300]
    assert httpx.get(f"{base}/health", timeout=HANG_GUARD_S).status_code == 200  # the server is unharmed


def test_body_limit_on_the_real_server(open_server):
    """64 KiB limit: a declared length over it and a chunked body (no length) that grows past it both get 413."""
    base, _, _ = open_server
    body = b"[" + b"1," * 40000 + b"1]"
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=HANG_GUARD_S)
    assert r.status_code == 413 and "0.0625 MiB (--max-body-mib)" in r.json()["error"]["message"]

    def chunks():
        for _ in range(40):
            yield b" " * 4096

    r = httpx.post(f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=HANG_GUARD_S)
    assert r.status_code == 413, r.text
    small = httpx.post(f"{base}/v1/completions", json={"model": "x", "prompt": "y"}, timeout=HANG_GUARD_S)
    assert small.status_code == 404  # within the limit: parsed (and the model name is wrong)


def test_cli_help_names_the_security_flags():
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "serve", "--help"], capture_output=True,
                         text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0
    for flag in ("--allow-unauthenticated", "--max-header-kib", "--max-body-mib", "--api-key"):
        assert flag in out.stdout, flag
