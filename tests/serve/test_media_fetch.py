"""Where a request's images and videos may come from (ninfer_serve.media_policy, media_fetch, media_parts): the
address rules, local files inside allowed folders only, data: URLs, and the remote fetcher against a local HTTP
server (the address check is replaced by one that lets 127.0.0.1 through, so the fetch path itself is exercised;
every other address, redirects included, still goes through the real rules)."""

from __future__ import annotations

import base64
import http.server
import os
import threading

import pytest
from ninfer_serve.errors import ApiError
from ninfer_serve.media_fetch import fetch, resolve
from ninfer_serve.media_parts import MediaRef, decode_data_url, load
from ninfer_serve.media_policy import MediaPolicy, address_refusal

BODY = b"\x89PNG" + bytes(range(256)) * 40


@pytest.mark.parametrize("address, why", [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.9", "private"), ("172.16.5.5", "private"),
    ("169.254.169.254", "link-local"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("::1", "loopback"),
    ("fc00::1", "private"), ("fe80::1", "link-local"), ("::ffff:127.0.0.1", "loopback"), ("100.64.0.1", "public"),
    ("240.0.0.1", "reserved")])
def test_non_public_addresses_are_refused(address, why):
    assert why in address_refusal(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_pass(address):
    assert address_refusal(address) is None


def test_local_files_only_inside_allowed_folders(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(BODY)
    (outside / "b.png").write_bytes(BODY)
    os.symlink(outside / "b.png", inside / "link.png")
    off = MediaPolicy()
    with pytest.raises(ApiError, match="--allowed-media-path"):
        off.local_path(str(inside / "a.png"), "p")
    on = MediaPolicy.of([inside])
    assert on.local_path(f"file://{inside / 'a.png'}", "p") == inside / "a.png"
    for escape in (str(inside / ".." / "secret" / "b.png"), str(inside / "link.png"), str(outside / "b.png")):
        with pytest.raises(ApiError, match="outside the allowed media folders"):
            on.local_path(escape, "p")
    with pytest.raises(ApiError, match="not a file"):
        on.local_path(str(inside), "p")
    with pytest.raises(ValueError, match="not a folder"):
        MediaPolicy.of([tmp_path / "missing"])


def test_data_urls():
    ref = MediaRef("image", "", "messages[0].content[1].image_url.url")
    good = "data:image/png;base64," + base64.b64encode(BODY).decode()
    assert decode_data_url(good, ref, 1 << 20) == BODY
    cases = {"data:image/png,abc": "must be base64", "data:text/plain;base64,QUJD": "is not an image",
             "data:image/png;base64,!!!!": "malformed"}
    for url, message in cases.items():
        with pytest.raises(ApiError, match=message) as exc:
            decode_data_url(url, ref, 1 << 20)
        assert exc.value.param == ref.param
    with pytest.raises(ApiError, match="exceeds 100 bytes"):
        decode_data_url(good, ref, 100)
    with pytest.raises(ApiError, match="scheme 'ftp' is not supported"):
        load(MediaRef("image", "ftp://example.com/a.png", "p"), MediaPolicy())


class _Handler(http.server.BaseHTTPRequestHandler):
    release = threading.Event()

    def log_message(self, *args):
        """Quiet: the test server writes no access log to stderr."""

    def do_GET(self):  # noqa: N802 - the http.server hook name
        if self.path == "/ok.png":
            self._send(200, BODY, length=True)
        elif self.path == "/chunked.png":   # no Content-Length: the cap must hold while streaming
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(BODY)
        elif self.path == "/slow.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.release.wait(30)
        elif self.path == "/to-private":
            self._redirect("http://10.0.0.7/x.png")
        elif self.path == "/to-metadata":
            self._redirect("http://169.254.169.254/latest/meta-data")
        elif self.path.startswith("/loop"):
            self._redirect(f"/loop{len(self.path)}")
        elif self.path == "/hop":
            self._redirect("/ok.png")
        else:
            self._send(404, b"no")

    def _send(self, status, body, length=True):
        self.send_response(status)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where):
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://media.test:{httpd.server_address[1]}"
    _Handler.release.set()
    httpd.shutdown()


def _loopback_ok(address):
    return None if address == "127.0.0.1" else address_refusal(address)


def _get(url, **policy):
    policy = MediaPolicy(allow_remote=True, **policy)
    return fetch(url, policy, "p", resolver=lambda host, port: ["127.0.0.1"] if host == "media.test"
                 else resolve(host, port), refusal=_loopback_ok)


def test_fetch_reads_the_body_and_follows_a_checked_redirect(server):
    assert _get(f"{server}/ok.png") == BODY
    assert _get(f"{server}/hop") == BODY


def test_fetch_refusals_name_the_problem(server):
    with pytest.raises(ApiError, match="remote media is off"):
        fetch(f"{server}/ok.png", MediaPolicy(), "p")
    with pytest.raises(ApiError, match=r"10\.0\.0\.7 is private"):
        _get(f"{server}/to-private")
    with pytest.raises(ApiError, match=r"169\.254\.169\.254 is link-local"):
        _get(f"{server}/to-metadata")
    with pytest.raises(ApiError, match="more than 3 redirects"):
        _get(f"{server}/loop")
    with pytest.raises(ApiError, match="exceeds 1000 bytes"):
        _get(f"{server}/ok.png", max_bytes=1000)      # refused on the declared length
    with pytest.raises(ApiError, match="exceeds 100000 bytes"):
        _get(f"{server}/chunked.png", max_bytes=100_000)   # refused while streaming
    with pytest.raises(ApiError, match="timed out"):
        _get(f"{server}/slow.png", timeout_s=0.3)
    with pytest.raises(ApiError, match="HTTP 404"):
        _get(f"{server}/missing.png")
    with pytest.raises(ApiError, match="only http and https"):
        _get("gopher://media.test/x")


def test_the_real_rules_refuse_a_loopback_host(server):
    # No replaced check: localhost resolves to a loopback address, which the real rules refuse.
    port = server.rsplit(":", 1)[1]
    with pytest.raises(ApiError, match="loopback"):
        fetch(f"http://localhost:{port}/ok.png", MediaPolicy(allow_remote=True), "p")
