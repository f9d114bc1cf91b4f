"""Images and videos on the command line, through a subprocess on a tiny vision artifact
(tests/support/vision_models.py): ``generate --image/--video`` (chat implied) prints what ``Engine.chat`` answers
for the same message, ``chat`` attaches ``/image PATH`` to the next message, and bad input fails clearly before
or instead of generating."""

from __future__ import annotations

import re

import pytest
from PIL import Image
from support.media import make_video, picture

FLAGS = ("--device", "cpu", "--max-context", "256", "-t", "0", "-n", "8", "--ignore-eos", "--no-thinking")


@pytest.fixture(scope="module")
def vision_artifact(tmp_path_factory):
    from support.vision_models import tiny_vision_artifact

    return tiny_vision_artifact(tmp_path_factory.mktemp("cli_vision"))[0]


@pytest.fixture(scope="module")
def media_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_media")
    Image.fromarray(picture(40, 28, seed=1)).save(root / "a.png")
    (root / "v.mp4").write_bytes(make_video(32, 24, 20, 10))
    return root / "a.png", root / "v.mp4"


def _api(artifact, content) -> tuple[str, int]:
    """The Python API's answer and prompt length for one user message."""
    from ninfer import Engine, EngineOptions

    with Engine.start(artifact, EngineOptions(device="cpu", max_context=256, context_cache=False)) as engine:
        messages = [{"role": "user", "content": content}]
        prompt = engine.frontend.prepare_chat(messages, enable_thinking=False)
        result = engine.chat(messages, enable_thinking=False, temperature=0.0, max_tokens=8, ignore_eos=True)
        return result.output.content, len(prompt.token_ids)


def _prompt_tokens(stderr: str) -> int:
    return int(re.search(r"\[ninfer\] (\d+) prompt \+ 8 generated tokens", stderr).group(1))


def test_generate_with_an_image_and_a_video(run_cli, vision_artifact, media_files):
    image, video = media_files
    out = run_cli("generate", str(vision_artifact), "--video", str(video), "--image", str(image), "-p", "Which?",
                  *FLAGS)
    assert out.returncode == 0, out.stderr
    answer, length = _api(vision_artifact, [{"type": "video", "video": str(video)},
                                            {"type": "image", "image": str(image)},
                                            {"type": "text", "text": "Which?"}])
    assert _prompt_tokens(out.stderr) == length
    assert out.stdout.rstrip("\n") == answer


def test_chat_attaches_an_image_to_the_next_message(run_cli, vision_artifact, media_files, tmp_path):
    image, _ = media_files
    saved = tmp_path / "conv.json"
    out = run_cli("chat", str(vision_artifact), *FLAGS,
                  stdin=f"/image {image}\n/image {tmp_path / 'missing.png'}\nWhat is it?\n/save {saved}\n")
    assert out.returncode == 0, out.stderr
    assert "image attached to your next message" in out.stderr and "no such file" in out.stderr
    answer, _ = _api(vision_artifact, [{"type": "image", "image": str(image)}, {"type": "text", "text": "What is it?"}])
    assert answer in out.stdout
    # The saved conversation replays with generate --messages (the image part keeps its path).
    import json

    messages = json.loads(saved.read_text())
    assert messages[0]["content"][0] == {"type": "image", "image": str(image)}


def test_bad_media_input_is_a_clear_error(run_cli, vision_artifact, media_files, tmp_path):
    image, _ = media_files
    missing = run_cli("generate", str(vision_artifact), "--image", str(tmp_path / "nope.png"), "-p", "x", *FLAGS)
    assert missing.returncode != 0 and "nope.png" in missing.stderr and "no such file" in missing.stderr
    assert "loaded" not in missing.stderr                  # refused before the model loads
    off = run_cli("generate", str(vision_artifact), "--no-vision", "--image", str(image), "-p", "x", *FLAGS)
    assert off.returncode != 0 and "vision off" in off.stderr
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not a picture")
    bad = run_cli("generate", str(vision_artifact), "--image", str(junk), "-p", "x", *FLAGS)
    assert bad.returncode != 0 and "not a complete file of an accepted format" in bad.stderr


def test_a_turn_refused_for_its_attachment_drops_it(run_cli, media_files):
    """The default model has no vision tower: the turn with the image is refused naming why, the attachment goes
    with it, and the next turn is answered (it used to fail every later turn with the same error)."""
    image, _ = media_files
    out = run_cli("chat", "--no-thinking", "-n", "4", "-t", "0", stdin=f"/image {image}\nhello\nsecond\n")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("without a vision tower") == 1 and "1 attachment(s) dropped" in out.stderr, out.stderr
    assert out.stdout.strip(), out.stderr   # the second turn's answer


def test_a_file_that_is_not_an_image_is_named(run_cli, vision_artifact, media_files, tmp_path):
    """With several --image flags the error says which file is bad."""
    image, _ = media_files
    fake = tmp_path / "fake.png"
    fake.write_bytes(b"not a png")
    out = run_cli("generate", str(vision_artifact), "--image", str(image), "--image", str(fake), "-p", "x", *FLAGS)
    assert out.returncode != 0 and f"{fake}: image: not a complete file of an accepted format" in out.stderr, \
        out.stderr
