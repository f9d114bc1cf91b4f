"""Stop strings across token boundaries and stop token ids."""

from __future__ import annotations

import pytest
from ninfer.contracts.frontend import OutputOptions
from ninfer_qwen3_5.frontend import FrontendError, QwenFrontend
from ninfer_qwen3_5.frontend.stop import StopStringMatcher

from .conftest import ENDOFTEXT, IM_END, stream

RAW = {"parse_reasoning": False, "parse_tool_calls": False}


def _ids_of_pieces(frontend: QwenFrontend, pieces: list[str]) -> list[int]:
    """Token ids whose boundaries fall between the given pieces (each piece encoded alone)."""
    return [i for p in pieces for i in frontend.encode(p)]


def test_stop_string_split_across_tokens(frontend: QwenFrontend):
    pieces = ["The answer", " is 42", ". ##", "#", "# END", " trailing", " words"]
    ids = _ids_of_pieces(frontend, pieces)
    assert frontend.decode(frontend.encode("# END")[:1]) == "#"
    stop_tokens = len(_ids_of_pieces(frontend, pieces[:4])) + 1  # "####" completes at piece 5's first token
    out = stream(frontend, ids, OutputOptions(stop=("####",), **RAW))
    assert out.previews[-1].finish_reason == "stop"
    assert out.previews[-1].stop_reason == "####"
    assert out.accepted == stop_tokens < len(ids)
    assert out.text("content") == "The answer is 42. " == out.final.content
    assert all("#" not in d.text for d in out.deltas)


def test_accepted_excludes_tokens_after_stop_in_one_preview(frontend: QwenFrontend):
    ids = _ids_of_pieces(frontend, ["alpha", " STOP", " beta", " gamma"])
    session = frontend.open_session(OutputOptions(stop=("STOP",), **RAW))
    preview = session.preview(ids)
    assert (preview.accepted, preview.finish_reason, preview.stop_reason) == (2, "stop", "STOP")
    assert "".join(d.text for d in preview.deltas) == "alpha "
    session.commit(preview)
    with pytest.raises(FrontendError):
        session.preview(frontend.encode(" more"))
    assert session.finish("stop").content == "alpha "


def test_held_partial_match_is_not_published_until_resolved(frontend: QwenFrontend):
    session = frontend.open_session(OutputOptions(stop=("<END>",), **RAW))
    held = session.preview(frontend.encode("x <EN"))
    assert "".join(d.text for d in held.deltas) == "x "  # "<EN" could still become "<END>"
    session.commit(held)
    resolved = session.preview(frontend.encode("Dless"))
    assert "".join(d.text for d in resolved.deltas) == "<ENDless"
    assert resolved.finish_reason is None


def test_partial_match_flushed_by_finish(frontend: QwenFrontend):
    out = stream(frontend, frontend.encode("value <EN"), OutputOptions(stop=("<END>",), **RAW))
    assert out.previews[-1].finish_reason is None
    assert [d.text for d in out.final.deltas] == ["<EN"]
    assert out.final.content == "value <EN"


def test_earliest_stop_wins_and_applies_to_reasoning(frontend: QwenFrontend):
    ids = frontend.encode("thinking about cats and dogs")
    out = stream(frontend, ids, OutputOptions(stop=("dogs", "cats and"), thinking_open=True), step=len(ids))
    assert out.previews[-1].stop_reason == "cats and"
    assert out.final.reasoning == "thinking about " and out.final.content == ""


def test_matcher_prefers_longest_on_tie():
    matcher, fed = StopStringMatcher(("bc", "abc")).feed("xxabcd")  # both complete at the same character
    assert fed.text == "xx" and fed.stop == "abc"


def test_first_completed_stop_wins_whatever_the_token_split():
    """"bc" completes before "abcd" does: fed whole or character by character, the output ends at "bc" (the
    earliest-starting rule alone gave "" whole and "a" split)."""
    stops = ("abcd", "bc")
    _, fed = StopStringMatcher(stops).feed("abcd")
    assert (fed.text, fed.stop) == ("a", "bc")
    matcher, text = StopStringMatcher(stops), ""
    for ch in "abcd":
        matcher, fed = matcher.feed(ch)
        text += fed.text
        if fed.stop:
            break
    assert (text, fed.stop) == ("a", "bc")
    with pytest.raises(FrontendError):
        StopStringMatcher(("",))


def test_eos_tokens_stop_and_are_not_published(frontend: QwenFrontend):
    for eos in (IM_END, ENDOFTEXT):
        ids = frontend.encode("Done.") + [eos] + frontend.encode(" junk")
        out = stream(frontend, ids, OutputOptions(**RAW))
        assert out.previews[-1].stop_reason == eos and out.previews[-1].finish_reason == "stop"
        assert out.accepted == len(frontend.encode("Done.")) + 1  # the stop token itself is accepted
        assert out.final.content == "Done."


def test_ignore_eos_and_extra_stop_ids(frontend: QwenFrontend):
    extra = frontend.encode(" fin")[0]
    ids = frontend.encode("a") + [IM_END] + frontend.encode(" b fin c")
    out = stream(frontend, ids, OutputOptions(ignore_eos=True, stop_token_ids=(extra,), **RAW))
    assert out.previews[-1].stop_reason == extra
    assert out.final.content == "a<|im_end|> b"
    with pytest.raises(FrontendError, match="outside the vocabulary"):
        frontend.open_session(OutputOptions(stop_token_ids=(10**7,)))


def test_stop_token_flushes_pending_partial_stop_string(frontend: QwenFrontend):
    ids = frontend.encode("result: ST") + [IM_END]
    out = stream(frontend, ids, OutputOptions(stop=("STOP",), **RAW))
    assert out.previews[-1].stop_reason == IM_END
    assert out.final.content == "result: ST"


def test_include_stop_str_publishes_a_stop_tokens_text_but_not_a_control_tokens(frontend: QwenFrontend):
    """vLLM's include_stop_str_in_output: a stop token's text ends the output with it, streamed in any chunking;
    a control token (EOS) publishes none; a held partial stop string comes first, as the text came."""
    extra = frontend.encode(" fin")[0]
    ids = frontend.encode("result: ST") + [extra] + frontend.encode(" junk")
    for step in (1, 3, len(ids)):
        out = stream(frontend, ids, OutputOptions(stop=("STOP",), stop_token_ids=(extra,), include_stop_str=True,
                                                  **RAW), step=step)
        assert out.previews[-1].stop_reason == extra and out.accepted == len(frontend.encode("result: ST")) + 1
        assert out.final.content == out.text("content") == "result: ST fin"
    plain = stream(frontend, ids, OutputOptions(stop_token_ids=(extra,), **RAW))
    assert plain.final.content == "result: ST"
    eos = stream(frontend, frontend.encode("Done.") + [IM_END], OutputOptions(include_stop_str=True, **RAW))
    assert eos.previews[-1].stop_reason == IM_END and eos.final.content == "Done."


def test_a_stop_string_in_the_stop_tokens_text_ends_the_output_as_that_string(frontend: QwenFrontend):
    """With include_stop_str the stop token's text goes through the stop strings like any other: a stop string it
    completes is what ended the output (vLLM decodes the token, then checks its stop strings)."""
    extra = frontend.encode(" fin")[0]
    ids = frontend.encode("a f") + [extra]
    out = stream(frontend, ids, OutputOptions(stop=("f fi",), stop_token_ids=(extra,), include_stop_str=True, **RAW))
    assert (out.previews[-1].finish_reason, out.previews[-1].stop_reason) == ("stop", "f fi")
    assert out.final.content == "a f fi"


def test_stop_strings_wait_for_min_tokens(frontend: QwenFrontend):
    """A stop string that completes within the first min_tokens tokens ends nothing (vLLM); one that completes
    later ends the output, even when it began earlier."""
    head, tail = frontend.encode("x STOP y"), frontend.encode(" ST")
    ids = head + tail + frontend.encode("OP z")
    early = stream(frontend, ids, OutputOptions(stop=("STOP",), **RAW))
    assert early.final.content == "x "
    held = stream(frontend, ids, OutputOptions(stop=("STOP",), min_tokens=len(head), **RAW))
    assert held.final.content == "x STOP y " and held.previews[-1].stop_reason == "STOP"
    # The second stop began in the first len(head) + 1 tokens and completes after them: it still ends the output.
    straddle = stream(frontend, ids, OutputOptions(stop=("STOP",), min_tokens=len(head) + 1, **RAW))
    assert straddle.final.content == "x STOP y "
    none = stream(frontend, ids, OutputOptions(stop=("STOP",), min_tokens=len(ids), **RAW))
    assert none.final.content == "x STOP y STOP z" and none.previews[-1].finish_reason is None
