"""The chat page's files as the server ships them (no browser; test_chat_page_browser drives the page itself):
served at ``/`` and ``/static/NAME`` with their content types and a strict CSP, open without the API key while
every API path (and any other ``/static`` name) still needs it, nothing loaded from outside the server, and
``ui=False`` (``--no-ui``) turning the page off."""

from __future__ import annotations

import re
from importlib import resources

import pytest
from ninfer_serve.routes_page import PAGE_FILES, page_paths
from serve_helpers import client_for

KEY = "page-key"


def test_page_files_are_served_with_their_content_types(scripted):
    with client_for(scripted) as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="/static/chat.js">' in r.text
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        expected = {"js": "text/javascript", "css": "text/css", "html": "text/html"}
        for name in PAGE_FILES:
            r = c.get(f"/static/{name}")
            assert r.status_code == 200, name
            assert r.headers["content-type"].startswith(expected[name.rsplit(".", 1)[1]]), name
            assert r.content == resources.files("ninfer_serve").joinpath("static", name).read_bytes()
        head = c.head("/")
        assert head.status_code == 200 and head.content == b""
        for bad in ("/static/nope.js", "/static/..%2Fapp.py", "/static/", "/static/__init__.py"):
            assert c.get(bad).status_code == 404, bad


def test_every_shipped_file_is_listed_and_loads_nothing_from_outside():
    shipped = {p.name for p in resources.files("ninfer_serve").joinpath("static").iterdir() if p.is_file()}
    assert shipped == set(PAGE_FILES)
    for name in shipped:
        text = resources.files("ninfer_serve").joinpath("static", name).read_text()
        # No absolute or protocol-relative URL anywhere: the page loads only its own files. (The markdown
        # renderer's link pattern names the schemes it accepts without a "//host".)
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "@import" not in text and "cdn" not in text.lower(), name


def test_page_is_open_without_the_key_and_the_api_is_not(scripted):
    assert page_paths() == {"/", "/static/index.html", "/static/chat.js", "/static/markdown.js", "/static/chat.css"}
    with client_for(scripted, api_key=KEY) as c:
        for path in page_paths():
            assert c.get(path).status_code == 200, path
        # Exact paths only: nothing under or beside them, and no API path, is opened by the page.
        for path in ("/v1/models", "/metrics", "/static/other.js", "/static/chat.js/x", "/index.html",
                     "//v1/models", "/static/../v1/models"):
            assert c.get(path).status_code == 401, path
        assert c.post("/v1/chat/completions", json={}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("api_key", [None, KEY])
def test_no_ui_turns_the_page_off(scripted, api_key):
    with client_for(scripted, ui=False, api_key=api_key) as c:
        headers = {"x-api-key": KEY} if api_key else {}
        for path in page_paths():
            assert c.get(path, headers=headers).status_code == 404, path
        if api_key:   # and with the page off its paths are closed like any other
            assert c.get("/").status_code == 401


def test_no_ui_flag_of_ninfer_serve(artifact):
    """``ninfer serve --no-ui``: the ready line names no page and ``/`` is a 404, while the API answers."""
    import signal
    import urllib.error
    import urllib.request

    from serve_helpers import start_server_process

    base, proc = start_server_process(artifact, "--device", "cpu", "--max-context", "256", "--no-warmup", "--no-ui",
                                      "--log-level", "warning", timeout=300)
    try:
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/", timeout=30)
        assert missing.value.code == 404
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    ready = [line for line in out.splitlines() if line.startswith("[ninfer] serving ")]
    assert ready and "chat page" not in ready[0], out
