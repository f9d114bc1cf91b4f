"""Property tests of Unicode detokenization with the real Qwen3.5 vocabulary (the frontend fixture).

- Round trip: any text without lone surrogates (which encode refuses, naming them) encodes and decodes back to
  itself, NFC-normalised (the tokenizer's normalizer), whatever its scripts, combining marks, emoji sequences,
  control characters or special-token strings.
- Streaming: for any split of the ids into steps, the incremental detokenizer's step texts plus its flush
  concatenate to the whole decode; the same holds for arbitrary ids (invalid UTF-8 included: U+FFFD exactly
  where the whole decode puts one), and for a session's published deltas (no stops, no parsing), whatever the
  preview grouping.
"""

from __future__ import annotations

import unicodedata

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ninfer.contracts.frontend import OutputOptions  # noqa: E402
from ninfer_qwen3_5.frontend import QwenFrontend  # noqa: E402
from ninfer_qwen3_5.frontend.detokenizer import DetokenizerState, IncrementalDetokenizer  # noqa: E402

from .conftest import stream  # noqa: E402

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"]
# Any code point but lone surrogates, weighted towards the hard cases: multi-byte scripts, combining marks,
# emoji with ZWJ and variation selectors, flags, and the special tokens' literal text.
TEXT = st.lists(st.one_of(
    st.characters(exclude_categories=("Cs",)),
    st.sampled_from(["é", "e\u0301", "你好", "👨\u200d👩\u200d👧", "🇯🇵", "👍🏽", "\u2764\ufe0f", "\r\n", "\t", "\x00",
                     "\U0010fffd", " "]),
    st.sampled_from(SPECIALS)), max_size=24).map("".join)
RAW = OutputOptions(parse_reasoning=False, parse_tool_calls=False, ignore_eos=True)


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, pos, k = [], 0, 0
    while pos < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[pos:pos + n])
        pos, k = pos + n, k + 1
    return out


def streamed(detok: IncrementalDetokenizer, steps: list[list[int]]) -> str:
    state, text = DetokenizerState(), ""
    for step in steps:
        for token in step:
            state, piece = detok.step(state, token)
            text += piece
    return text + IncrementalDetokenizer.flush(state)


@given(text=TEXT)
def test_any_text_round_trips(frontend: QwenFrontend, text):
    ids = frontend.encode(text)
    assert frontend.decode(ids) == unicodedata.normalize("NFC", text)


@given(text=TEXT, sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_streamed_detokenization_concatenates_to_the_whole(frontend: QwenFrontend, text, sizes):
    ids = frontend.encode(text)
    detok = IncrementalDetokenizer(frontend.tokenizer.token_bytes)
    assert streamed(detok, split(ids, sizes)) == frontend.decode(ids)


@given(ids=st.lists(st.integers(0, 248_300), max_size=12), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_arbitrary_ids_stream_like_the_whole_decode(frontend: QwenFrontend, ids, sizes):
    """Ids past the vocabulary decode to nothing, as ``decode`` does."""
    detok = IncrementalDetokenizer(frontend.tokenizer.token_bytes)
    whole = frontend.decode(ids)
    assert streamed(detok, split(ids, sizes)) == whole
    table = frontend.tokenizer.token_bytes
    assert whole == b"".join(table[i] for i in ids if i < len(table)).decode("utf-8", "replace")


@given(text=TEXT.map(lambda t: "".join(c for c in t if c not in "<|>")),  # no special token: nothing stops
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_session_deltas_concatenate_to_the_whole(frontend: QwenFrontend, text, sizes):
    ids = frontend.encode(text)
    out = stream(frontend, ids, RAW, step=sizes)
    assert out.text("content") == out.final.content == frontend.decode(ids) == unicodedata.normalize("NFC", text)
    assert out.accepted == len(ids)
