"""Property tests of the OutputSession's hold-back stages: stop strings and the reasoning split, for any way the
model's bytes are split into tokens and the tokens into previews.

A synthetic vocabulary makes every split reachable: the UTF-8 bytes of a random text (markers, newlines and
multi-byte characters included) are cut at random byte offsets, mid-character too, and piece ``i`` is token
``i``. The session runs as the engine drives it (preview a group of tokens, commit, stop at a terminal preview,
finish). Whatever the splits, what it publishes must equal an independent reference computed from the whole text:

- stop strings: the output ends at the stop string that completes first (the earliest-starting of those completing
  at the same character), at the token that completed it; nothing from the stop string on is published, and a
  stop string never completed is published at the end (hold-back only delays text, never drops it);
- reasoning: with ``thinking_open`` the text up to the first ``</think>`` is reasoning (newlines at both ends not
  published) and the rest content (leading newlines not published); without it, a ``<think>`` opening the output
  (after whitespace) starts reasoning, anything else is all content, verbatim;
- the published deltas of each channel, in order, plus what ``finish`` flushes, are exactly the final text of that
  channel; a cut-off multi-byte character at the very end is one U+FFFD, as the whole-text decode gives.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ninfer.contracts.frontend import OutputOptions  # noqa: E402
from ninfer_qwen3_5.frontend.detokenizer import IncrementalDetokenizer  # noqa: E402
from ninfer_qwen3_5.frontend.output_session import QwenOutputSession  # noqa: E402

OPEN, CLOSE = "<think>", "</think>"
CHARS = ["a", "b", " ", "\n", "<", ">", "/", "t", "é", "€", "🇯"]
TEXT = st.lists(st.one_of(st.sampled_from(CHARS), st.sampled_from([OPEN, CLOSE, "\n\n", "ab"])),
                max_size=14).map("".join)
STOPS = st.lists(st.one_of(st.text(st.sampled_from(["a", "b", "\n", "<", "/", ">", "é", "€"]), min_size=1,
                                   max_size=3),
                           st.sampled_from([CLOSE, "</", "ab", "b\n", "🇯"])), max_size=3, unique=True)


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None, int]:
    """(published text, the stop string hit or None, the character offset where it completed)."""
    best = None
    for stop in stops:
        start = text.find(stop)  # the first occurrence of a stop string is also its first completion
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is None:
        return text, None, len(text)
    end, start, stop = best
    return text[:start], stop, end


def reference_split(text: str, thinking_open: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole output under the module's whitespace rule."""
    if thinking_open:
        rest = text
    else:
        body = text.lstrip()
        if not body.startswith(OPEN):
            return "", text
        rest = body[len(OPEN):]
    end = rest.find(CLOSE)
    if end < 0:
        return rest.strip("\n"), ""
    return rest[:end].strip("\n"), rest[end + len(CLOSE):].lstrip("\n")


@st.composite
def tokenized(draw):
    """A text, its UTF-8 bytes cut into tokens at random offsets (the last 0-3 bytes possibly dropped: an output
    cut mid-character), and how the tokens are grouped into previews."""
    text = draw(TEXT)
    data = text.encode()
    data = data[:len(data) - draw(st.integers(0, min(3, len(data))))]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))) - {len(data)})
    bounds = [0, *cuts, len(data)]
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    groups = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    return data, pieces, groups


def run_session(pieces: list[bytes], groups: list[int], options: OutputOptions):
    session = QwenOutputSession(IncrementalDetokenizer(pieces), options, eos_token_ids=(), call_id_prefix="t")
    tokens = list(range(len(pieces)))
    previews, pos, k = [], 0, 0
    finish = "length"
    while pos < len(tokens):
        preview = session.preview(tokens[pos:pos + groups[k % len(groups)]])
        k += 1
        session.commit(preview)
        previews.append(preview)
        pos += preview.accepted
        if preview.finish_reason is not None:
            finish = preview.finish_reason
            break
    final = session.finish(finish)
    return previews, final


def published(previews, final, channel: str) -> str:
    deltas = [d for p in previews for d in p.deltas] + list(final.deltas)
    assert all(not d.tool_calls for d in deltas)
    return "".join(d.text for d in deltas if d.channel == channel)


# Cheap examples (no model, no tokenizer): many more than the profile's default.
MANY = settings(max_examples=max(400, settings.default.max_examples))


@MANY
@given(case=tokenized(), stops=STOPS)
def test_stop_strings_cut_the_same_text_whatever_the_token_split(case, stops):
    data, pieces, groups = case
    text = data.decode("utf-8", "replace")
    previews, final = run_session(pieces, groups, OutputOptions(stop=tuple(stops), parse_reasoning=False,
                                                                parse_tool_calls=False))
    want, stop, end = reference_stop(text, stops)
    assert published(previews, final, "content") == final.content == want
    assert final.reasoning == ""
    accepted = sum(p.accepted for p in previews)
    if stop is None:
        assert accepted == len(pieces) and all(p.finish_reason is None for p in previews)
        return
    assert (previews[-1].finish_reason, previews[-1].stop_reason) == ("stop", stop)
    # The stop string's last character arrived with the token holding its last byte.
    last_byte = len(text[:end].encode())
    sizes = [len(p) for p in pieces]
    assert accepted == next(i + 1 for i in range(len(sizes)) if sum(sizes[:i + 1]) >= last_byte)


@MANY
@given(case=tokenized(), stops=STOPS)
def test_include_stop_str_publishes_the_stop_string_too(case, stops):
    data, pieces, groups = case
    text = data.decode("utf-8", "replace")
    options = OutputOptions(stop=tuple(stops), parse_reasoning=False, parse_tool_calls=False, include_stop_str=True)
    previews, final = run_session(pieces, groups, options)
    want, stop, _ = reference_stop(text, stops)
    assert published(previews, final, "content") == final.content == want + (stop or "")


def reference_stop_after(data: bytes, pieces: list[bytes], stops: list[str], min_tokens: int):
    """vLLM's rule for stop strings under ``min_tokens``: (published text, the stop string hit or None). Only a stop
    string that completes in a token after the first ``min_tokens`` ends the output (it may begin before them)."""
    text = data.decode("utf-8", "replace")
    if len(pieces) <= min_tokens:
        return text, None
    floor = len(b"".join(pieces[:min_tokens]).decode("utf-8", "ignore"))   # characters those tokens completed
    best = None
    for stop in stops:
        start = text.find(stop, max(0, floor - len(stop) + 1))   # the first occurrence ending after them
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[:best[1]], best[2])


@MANY
@given(case=tokenized(), stops=STOPS, min_tokens=st.integers(0, 12), include=st.booleans())
def test_stop_strings_end_nothing_before_min_tokens(case, stops, min_tokens, include):
    """Whatever the token split: a stop string ends the output only if it completes after the first ``min_tokens``
    tokens, and the text before it is published in full (with the string if ``include_stop_str``)."""
    data, pieces, groups = case
    options = OutputOptions(stop=tuple(stops), parse_reasoning=False, parse_tool_calls=False, min_tokens=min_tokens,
                            include_stop_str=include)
    previews, final = run_session(pieces, groups, options)
    want, stop = reference_stop_after(data, pieces, stops, min_tokens)
    assert published(previews, final, "content") == final.content == want + (stop or "" if include else "")
    assert (previews[-1].stop_reason if previews and previews[-1].finish_reason else None) == stop
    if stop is not None:
        assert sum(p.accepted for p in previews) > min_tokens


@MANY
@given(case=tokenized(), stops=STOPS, thinking_open=st.booleans())
def test_reasoning_split_and_stops_whatever_the_token_split(case, stops, thinking_open):
    data, pieces, groups = case
    text = data.decode("utf-8", "replace")
    previews, final = run_session(pieces, groups, OutputOptions(stop=tuple(stops), thinking_open=thinking_open,
                                                                parse_tool_calls=False))
    cut, _, _ = reference_stop(text, stops)
    reasoning, content = reference_split(cut, thinking_open)
    assert (final.reasoning, final.content) == (reasoning, content)
    assert published(previews, final, "reasoning") == reasoning
    assert published(previews, final, "content") == content
