"""The preview/commit protocol of QwenOutputSession."""

from __future__ import annotations

import pytest
from ninfer.contracts.frontend import OutputOptions, OutputSession
from ninfer_qwen3_5.frontend import FrontendError, QwenFrontend, QwenOutputSession

from .conftest import IM_END, stream

OPTIONS = OutputOptions(stop=("STOP",), thinking_open=True, tools=(
    {"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}},))
OUTPUT = "Reason 🇯🇵.\n</think>\n\nText <tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n</function>\n" \
         "</tool_call> tail STOP ignored"


def test_implements_the_protocol(frontend: QwenFrontend):
    assert isinstance(frontend.open_session(OutputOptions()), OutputSession)


def test_preview_is_pure(frontend: QwenFrontend):
    ids = frontend.encode(OUTPUT)
    session = frontend.open_session(OPTIONS)
    for pos in range(0, len(ids), 3):
        chunk = ids[pos:pos + 3]
        first = session.preview(chunk)
        session.preview(frontend.encode(" something else entirely <tool_call>"))  # discarded
        again = session.preview(chunk)
        assert again == first
        session.commit(again)
        if again.finish_reason:
            break
    reference = stream(frontend, ids, OPTIONS, step=3)
    final = session.finish("stop")
    assert (final.content, final.reasoning) == (reference.final.content, reference.final.reasoning)
    assert [dict(c.arguments) for c in final.tool_calls] == [{"n": 7}]


def test_nothing_published_before_commit(frontend: QwenFrontend):
    session = frontend.open_session(OutputOptions(thinking_open=True))
    preview = session.preview(frontend.encode("hidden reasoning</think>hidden content"))
    assert preview.deltas  # the preview shows what would be published...
    final = session.finish("cancelled")  # ...but without commit nothing was
    assert (final.content, final.reasoning, final.deltas) == ("", "", ())


def test_commit_needs_the_latest_preview(frontend: QwenFrontend):
    session = frontend.open_session(OutputOptions())
    old = session.preview(frontend.encode("a"))
    latest = session.preview(frontend.encode("b"))
    with pytest.raises(FrontendError, match="most recent preview"):
        session.commit(old)
    session.commit(latest)
    with pytest.raises(FrontendError):
        session.commit(latest)  # a preview commits once
    assert session.finish("length").content == "b"


def test_same_text_any_chunking(frontend: QwenFrontend):
    ids = frontend.encode(OUTPUT)
    results = {(r.final.content, r.final.reasoning, tuple((c.name, c.arguments["n"]) for c in r.final.tool_calls),
                r.accepted)
               for r in (stream(frontend, ids, OPTIONS, step=s) for s in (1, 2, 5, [3, 1, 4], len(ids)))}
    # Whitespace next to a tool call is formatting (dropped); the token " STOP" completes the stop string.
    stop_at = len(frontend.encode(OUTPUT.split(" STOP")[0])) + 1
    assert results == {("Texttail ", "Reason 🇯🇵.", (("f", 7),), stop_at)}


def test_finish_closes_the_session(frontend: QwenFrontend):
    session = frontend.open_session(OutputOptions())
    session.commit(session.preview(frontend.encode("x") + [IM_END]))
    final = session.finish("stop")
    assert final.content == "x"
    for action in (lambda: session.preview([1]), lambda: session.finish("stop")):
        with pytest.raises(FrontendError):
            action()


def test_empty_preview(frontend: QwenFrontend):
    session = frontend.open_session(OutputOptions())
    preview = session.preview([])
    assert (preview.accepted, preview.finish_reason, preview.deltas) == (0, None, ())


def test_call_ids_are_deterministic_within_a_session(frontend: QwenFrontend):
    session = QwenOutputSession(frontend._detokenizer, OPTIONS, frontend.eos_token_ids, call_id_prefix="abc")
    ids = frontend.encode(OUTPUT)
    preview = session.preview(ids)
    assert session.preview(ids) == preview
    assert [c.id for d in preview.deltas for c in d.tool_calls] == ["call_abc_0"]
