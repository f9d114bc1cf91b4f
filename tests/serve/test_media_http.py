"""Images over HTTP (issue 33 items 5 and 6) on the tiny vision model: an OpenAI ``image_url`` part (data: URL, or
a file inside ``--allowed-media-path``) and an Anthropic base64 ``image`` block give the answer the Python API gives
for the same picture; a bad or refused image is a 400 naming the part, and the server keeps serving."""

from __future__ import annotations

import base64

import pytest
from ninfer import Engine, EngineOptions
from ninfer_serve.media_policy import MediaPolicy
from serve_helpers import MODEL_ID, client_for


@pytest.fixture(scope="module")
def picture():
    pytest.importorskip("PIL")
    import io

    from PIL import Image
    from support.media import picture as make

    buf = io.BytesIO()
    Image.fromarray(make(40, 28, seed=1)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from support.vision_models import tiny_vision_artifact

    artifact, _ = tiny_vision_artifact(tmp_path_factory.mktemp("media_http"))
    with Engine.start(artifact, EngineOptions(device="cpu", dtype="float32", max_context=256, page_size=4,
                                              max_concurrency=2)) as e:
        yield e


def expected(engine, picture) -> str:
    result = engine.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                       {"type": "image", "image": picture}]}],
                         enable_thinking=False, temperature=0.0, max_tokens=8, ignore_eos=True)
    return result.output.content


def openai_request(url: str) -> dict:
    return {"model": MODEL_ID, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


def test_openai_data_url_and_allowed_file_equal_the_python_api(engine, picture, tmp_path):
    want = expected(engine, picture)
    data = "data:image/png;base64," + base64.b64encode(picture).decode()
    (tmp_path / "p.png").write_bytes(picture)
    with client_for(engine, media=MediaPolicy.of([tmp_path])) as client:
        for url in (data, f"file://{tmp_path / 'p.png'}"):
            r = client.post("/v1/chat/completions", json=openai_request(url))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want


def test_anthropic_base64_image_equals_the_python_api(engine, picture):
    want = expected(engine, picture)
    body = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(picture).decode()}}]}]}
    with client_for(engine) as client:
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
    assert text == want[: len(text)] and text


def test_refused_images_are_400s_naming_the_part(engine, picture, tmp_path):
    where = "messages[0].content[1].image_url.url"
    cases = {
        "data:image/png;base64,AAAA": ("image", where),   # decodes to 3 bytes: not an image
        "file:///etc/passwd": ("local media files are off", where),
        "http://127.0.0.1/x.png": ("remote media is off", where),
        "data:text/plain;base64,QUJD": ("is not an image", where),
    }
    with client_for(engine) as client:
        for url, (message, param) in cases.items():
            r = client.post("/v1/chat/completions", json=openai_request(url))
            assert r.status_code == 400, (url, r.text)
            err = r.json()["error"]
            assert message in err["message"] and err["param"] in (param, "messages"), (url, err)
        bad = openai_request("x")
        bad["messages"][0]["content"][1] = {"type": "image_url"}
        r = client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1].image_url"
        system = openai_request("data:image/png;base64,AAAA")
        system["messages"][0]["role"] = "system"
        r = client.post("/v1/chat/completions", json=system)
        assert r.status_code == 400 and "only user messages" in r.json()["error"]["message"]
        # The server still serves.
        data = "data:image/png;base64," + base64.b64encode(picture).decode()
        assert client.post("/v1/chat/completions", json=openai_request(data)).status_code == 200


def test_openai_video_url_equals_the_python_api(engine):
    pytest.importorskip("av")
    from support.media import make_video

    video = make_video(32, 24, 8, 4)
    want = engine.chat([{"role": "user", "content": [{"type": "text", "text": "What happens?"},
                                                     {"type": "video", "video": video}]}],
                       enable_thinking=False, temperature=0.0, max_tokens=8, ignore_eos=True).output.content
    body = openai_request("")
    body["messages"][0]["content"] = [{"type": "text", "text": "What happens?"},
                                      {"type": "video_url", "video_url": {
                                          "url": "data:video/mp4;base64," + base64.b64encode(video).decode()}}]
    with client_for(engine) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        body["messages"][0]["content"][1]["type"] = "input_video"   # the same part under its other name
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
