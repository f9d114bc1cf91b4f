"""The <think>...</think> channel split, with the prompt opening <think> and with the model emitting it."""

from __future__ import annotations

import pytest
from ninfer.contracts.frontend import OutputOptions
from ninfer_qwen3_5.frontend import QwenFrontend
from ninfer_qwen3_5.frontend.reasoning import ReasoningSplitter

from .conftest import IM_END, stream


def _split(text: str, thinking_open: bool, cuts: int | None = None) -> tuple[str, str]:
    """Feed the splitter ``text`` in pieces of ``cuts`` characters (whole when None); flush at the end."""
    splitter, got = ReasoningSplitter.start(thinking_open), {"reasoning": "", "content": ""}
    size = cuts or len(text) or 1
    for pos in range(0, len(text), size):
        splitter, pieces = splitter.feed(text[pos:pos + size])
        for channel, piece in pieces:
            got[channel] += piece
    for channel, piece in splitter.flush():
        got[channel] += piece
    return got["reasoning"], got["content"]


CASES = [
    # (output text, thinking_open, expected reasoning, expected content)
    ("Let me think.\n</think>\n\nThe answer is 4.", True, "Let me think.", "The answer is 4."),
    ("\nstep 1\n\nstep 2\n\n</think>\n\nAnswer\n", True, "step 1\n\nstep 2", "Answer\n"),
    ("<think>\nhmm\n</think>\n\nDone", False, "hmm", "Done"),
    ("  \n<think>x</think>y", False, "x", "y"),
    ("no thinking here", False, "", "no thinking here"),
    ("  leading spaces kept", False, "", "  leading spaces kept"),
    ("never closed\n\n", True, "never closed", ""),
    ("partial close </thi", True, "partial close </thi", ""),
    ("<thi", False, "", "<thi"),
    ("text then <think>not reasoning</think>", False, "", "text then <think>not reasoning</think>"),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("</think>\n\nonly content", True, "", "only content"),
]


@pytest.mark.parametrize("text,thinking_open,reasoning,content", CASES)
@pytest.mark.parametrize("cuts", [None, 1, 2, 3])
def test_split_any_chunking(text, thinking_open, reasoning, content, cuts):
    assert _split(text, thinking_open, cuts) == (reasoning, content)


def test_feed_is_pure():
    start = ReasoningSplitter.start(True)
    first = start.feed("abc\n</thi")
    assert start.feed("abc\n</thi") == first and start == ReasoningSplitter.start(True)
    assert first[1] == (("reasoning", "abc"),)  # the newline and the partial marker are held


@pytest.mark.parametrize("thinking_open", [True, False])
def test_session_streams_reasoning_then_content(frontend: QwenFrontend, thinking_open: bool):
    body = "用户问 2+2。🤔 Simple.\n</think>\n\nIt is **4** 🎉."
    text = body if thinking_open else "<think>\n" + body
    ids = frontend.encode(text) + [IM_END]
    assert frontend.encode("</think>")[0] in ids  # a single special token, as the model emits it
    out = stream(frontend, ids, OutputOptions(thinking_open=thinking_open))
    assert out.text("reasoning") == out.final.reasoning == "用户问 2+2。🤔 Simple."
    assert out.text("content") == out.final.content == "It is **4** 🎉."
    channels = [d.channel for d in out.deltas]
    assert channels == sorted(channels, key=lambda c: c != "reasoning")  # all reasoning precedes content


def test_thinking_disabled_prompt_gives_content_only(frontend: QwenFrontend):
    prompt = frontend.prepare_chat([{"role": "user", "content": "hi"}], enable_thinking=False)
    out = stream(frontend, frontend.encode("Hello! <think> is just text here."),
                 OutputOptions(thinking_open=prompt.thinking_open))
    assert out.final.reasoning == "" and out.final.content == "Hello! <think> is just text here."


def test_parse_reasoning_off_publishes_raw_text(frontend: QwenFrontend):
    ids = frontend.encode("r\n</think>\n\nc")
    out = stream(frontend, ids, OutputOptions(thinking_open=True, parse_reasoning=False))
    assert out.final.content == "r\n</think>\n\nc" and out.final.reasoning == ""
