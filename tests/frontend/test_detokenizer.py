"""Incremental detokenization: streamed text equals the whole decode and never shows U+FFFD for a
character split across byte-level tokens."""

from __future__ import annotations

import random

import pytest
from ninfer.contracts.frontend import OutputOptions
from ninfer_qwen3_5.frontend import QwenFrontend
from ninfer_qwen3_5.frontend.detokenizer import DetokenizerState, IncrementalDetokenizer

from .conftest import stream

RAW = OutputOptions(parse_reasoning=False, parse_tool_calls=False, ignore_eos=True)
TEXTS = {
    "chinese": "量子计算机利用叠加和纠缠来处理信息。龘靐齉齾，𠀀𪚥（扩展区汉字）。",
    "emoji_zwj": "Family 👨‍👩‍👧‍👦, couple 👩‍❤️‍💋‍👨, profession 🧑🏿‍🚀, rainbow 🏳️‍🌈 done",
    "flags": "🇺🇸🇨🇳🇯🇵🇩🇪🏴󠁧󠁢󠁳󠁣󠁴󠁿 flags",
    "code": "fn main() {\n    let v: Vec<u8> = vec![0xF0, 0x9F];\n    println!(\"{:?} → λ\", v);\n}\n",
    "mixed": "Ünïcödé façade — naïve café; русский текст; العربية; हिन्दी; 한국어 텍스트 🎉",
}


def _has_split_character(frontend: QwenFrontend, ids: list[int]) -> bool:
    """At least one token is not valid UTF-8 on its own: a naive per-token decode would show U+FFFD."""
    return any("\ufffd" in frontend.decode([i]) for i in ids)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_token_by_token_stream(frontend: QwenFrontend, name: str):
    ids = frontend.encode(TEXTS[name])
    if name != "code":
        assert _has_split_character(frontend, ids), "the sample must exercise split characters"
    out = stream(frontend, ids, RAW)
    assert out.accepted == len(ids)
    assert all("\ufffd" not in d.text for d in out.deltas)
    assert out.text("content") == frontend.decode(ids) == out.final.content
    assert out.text("reasoning") == ""


@pytest.mark.parametrize("seed", range(4))
def test_random_token_chunks(frontend: QwenFrontend, seed: int):
    rng = random.Random(seed)
    ids = frontend.encode("".join(TEXTS.values()))
    out = stream(frontend, ids, RAW, step=[rng.randrange(1, 6) for _ in range(50)])
    assert all("\ufffd" not in d.text for d in out.deltas)
    assert out.text("content") == frontend.decode(ids)


@pytest.mark.parametrize("seed", range(6))
def test_random_byte_splits(seed: int):
    """Any split of the byte stream (not only token boundaries) publishes whole characters only."""
    rng = random.Random(seed)
    data = "".join(TEXTS.values()).encode("utf-8")
    state, parts, pos = DetokenizerState(), [], 0
    while pos < len(data):
        n = rng.randrange(1, 5)
        state, text = IncrementalDetokenizer.feed_bytes(state, data[pos:pos + n])
        assert "\ufffd" not in text
        parts.append(text)
        pos += n
    assert state.pending == b""
    assert "".join(parts) == data.decode("utf-8")


def test_invalid_bytes_match_whole_decode(frontend: QwenFrontend):
    """Bytes that never form a character show U+FFFD exactly as the whole decode does."""
    table = frontend.tokenizer.token_bytes
    lone = [i for i, b in enumerate(table[:5000]) if len(b) == 1 and b[0] >= 0x80]
    cont, lead = next(i for i in lone if table[i][0] < 0xC0), next(i for i in lone if table[i][0] >= 0xE0)
    ids = frontend.encode("a") + [cont] + frontend.encode("b") + [lead] + frontend.encode("c") + [lead]
    out = stream(frontend, ids, RAW)
    assert out.text("content") == frontend.decode(ids)
    assert out.text("content").count("\ufffd") == 3
    # The trailing incomplete lead byte is only known to be bad at the end: finish() flushes it.
    assert out.final.deltas and out.final.deltas[-1].text.endswith("\ufffd")


def test_step_is_pure(frontend: QwenFrontend):
    detok = IncrementalDetokenizer(frontend.tokenizer.token_bytes)
    ids = frontend.encode("🇯🇵")
    state = DetokenizerState()
    first = detok.step(state, ids[0])
    assert detok.step(state, ids[0]) == first and state == DetokenizerState()
    assert first[1] == "" and first[0].pending
