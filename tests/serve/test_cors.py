"""CORS is off by default and on for the origins ``--allowed-origins`` names; a preflight is answered before the
API-key check (browsers send it without credentials)."""

from __future__ import annotations

import pytest
from ninfer.errors import NInferError
from serve_helpers import client_for

PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_no_cors_headers_by_default(engine):
    with client_for(engine) as c:
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origin_gets_cors_headers_and_a_keyless_preflight(engine):
    with client_for(engine, allowed_origins=("http://localhost:3000",), api_key="k") as c:
        pre = c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code in (200, 204), pre.text
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = c.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("raw", ["", "localhost:3000", "http://x/path", "ftp://x"])
def test_bad_origins_are_refused_by_name(raw):
    from ninfer_serve.cli import allowed_origins

    with pytest.raises(NInferError, match="--allowed-origins"):
        allowed_origins(raw)


def test_origins_parse():
    from ninfer_serve.cli import allowed_origins

    assert allowed_origins(None) == ()
    assert allowed_origins("*") == ("*",)
    assert allowed_origins("http://a:1, https://b") == ("http://a:1", "https://b")
