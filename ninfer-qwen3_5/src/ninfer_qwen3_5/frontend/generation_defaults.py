"""Model-side generation defaults: sampling values and EOS ids from the artifact's resources.

Invariants:
- Only values the model's ``generation_config.json`` states are defaults; nothing is guessed from the
  architecture. ``do_sample: false`` means greedy (temperature 0), as in HF generation.
- EOS ids are the union, in order, of ``generation_config.eos_token_id`` (int or list) and the
  tokenizer config's ``eos_token``; Qwen3.5 needs both (``<|im_end|>`` ends a turn, ``<|endoftext|>`` a
  document). An artifact that names none is rejected: such a model could never stop.
- A request's own values win over the defaults (:func:`apply_request_values`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.tokenizer import QwenTokenizer

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: Mapping[str, Any]
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_configs(cls, generation_config: Mapping[str, Any] | None, tokenizer_config: Mapping[str, Any] | None,
                     tokenizer: QwenTokenizer) -> GenerationDefaults:
        gen = generation_config or {}
        sampling = {k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            sampling["temperature"] = 0.0
        for key, value in sampling.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FrontendError(f"generation_config.json: {key}={value!r} is not a number")
            if key == "top_k" and isinstance(value, float):   # JSON writers may store 20 as 20.0
                if not value.is_integer():
                    raise FrontendError(f"generation_config.json: top_k={value!r} is not an integer")
                sampling[key] = int(value)
        return cls(MappingProxyType(sampling), _eos_ids(gen, tokenizer_config or {}, tokenizer))


def _eos_ids(gen: Mapping[str, Any], tok_config: Mapping[str, Any], tokenizer: QwenTokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    raw = gen.get("eos_token_id")
    for value in (raw if isinstance(raw, list) else [] if raw is None else [raw]):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < tokenizer.vocab_size:
            raise FrontendError(f"generation_config.json: eos_token_id {value!r} is not a token id of the vocabulary")
        ids.append(value)
    token = tok_config.get("eos_token")
    if isinstance(token, Mapping):  # the AddedToken dict form
        token = token.get("content")
    if token is not None:
        tid = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if tid is None:
            raise FrontendError(f"tokenizer_config.json: eos_token {token!r} is not in the vocabulary")
        ids.append(tid)
    unique = tuple(dict.fromkeys(ids))
    if not unique:
        raise FrontendError("no EOS token: generation_config.json eos_token_id or tokenizer_config.json eos_token "
                            "is required")
    return unique


def apply_request_values(defaults: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults overridden by every value the request states (None means 'not stated')."""
    merged = dict(defaults)
    merged.update({k: v for k, v in request.items() if v is not None})
    return merged
