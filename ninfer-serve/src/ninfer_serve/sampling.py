"""Protocol sampling fields -> the engine's SamplingParams, and the output-length policy.

Output length follows vLLM: a request's ``max_tokens`` must fit in the context left after its prompt
(a larger value is a 400 naming the field, with OpenAI's code ``context_length_exceeded``, rather than a
silently shorter answer); a request without
one may use all of that room. Values a request leaves out take the model's generation_config defaults
(``Engine.sampling_params``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contracts.sampling import InvalidSamplingParams, SamplingParams

from ninfer_serve.errors import CONTEXT_SETTING, ApiError, context_length_error, from_engine_error

INT63 = 2**63


def output_budget(requested: int | None, *, prompt_tokens: int, max_context: int, field: str,
                  prompt_field: str, defaulted: bool = False) -> int:
    """The output budget: ``requested`` if it fits the context left after the prompt, all of it when None.
    ``defaulted``: the request did not set ``field`` and ``requested`` is the API's default (Completions' 16),
    which the error then says, rather than blaming a value the client never sent."""
    room = max_context - prompt_tokens
    if room < 1:
        raise context_length_error(f"this model's maximum context length is {max_context} tokens "
                                   f"({CONTEXT_SETTING}), but the prompt has {prompt_tokens} tokens, which leaves "
                                   "no room for output", prompt_field)
    if requested is None:
        return room
    if requested > room:
        what = (f"the default '{field}' of {requested} (the request did not set it) is too large"
                if defaulted else f"'{field}' is too large: {requested}")
        raise context_length_error(f"{what[0].upper()}{what[1:]}. This model's maximum context length is "
                                   f"{max_context} tokens ({CONTEXT_SETTING}) and the prompt has {prompt_tokens} "
                                   f"tokens ({requested} > {max_context} - {prompt_tokens})", field)
    return requested


def min_tokens(requested: int | None, budget: int, field: str, *, source: str = "set") -> int:
    """vLLM's ``min_tokens`` for OutputOptions: at most the output budget, as vLLM requires of max_tokens.
    ``field`` names the length field; ``source`` says where the budget came from: "set" (the request's ``field``),
    "default" (``field``'s default) or "context" (no length field: the context left after the prompt)."""
    value = requested or 0
    if value > budget:
        bound = {"set": f"{field} ({budget})", "default": f"{field} ({budget}, its default: the request did not "
                                                           f"set it)",
                 "context": f"the output budget ({budget} tokens: the context left after the prompt, as the "
                            f"request sets no {field})"}[source]
        raise ApiError("invalid_request", f"min_tokens ({value}) must be at most {bound}", param="min_tokens")
    return value


def engine_seed(seed: int | None) -> int | None:
    """OpenAI seeds are signed 64-bit, the engine's are [0, 2**63): a negative seed is taken modulo
    2**63 (deterministic, so the same seed always gives the same tokens)."""
    return None if seed is None else seed % INT63


def openai_fields(req: Any) -> dict[str, Any]:
    """The SamplingParams fields of an OpenAI request (``openai_models.SamplingFields``), read the same way
    by Chat Completions and Completions; each adds its own logprobs fields, which differ in shape."""
    return {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty, "seed": engine_seed(req.seed),
            "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos or None}


def build(engine: Any, fields: Mapping[str, Any], *, max_tokens: int) -> SamplingParams:
    """``fields``: the engine's SamplingParams names; None values are left to the model's defaults.
    Raises a 400 ApiError naming the bad field."""
    overrides = {k: v for k, v in fields.items() if v is not None}
    if overrides.get("top_k") == -1:  # vLLM's spelling of "disabled"
        overrides["top_k"] = 0
    if "stop_token_ids" in overrides:
        overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
    overrides["max_tokens"] = max_tokens
    try:
        return engine.sampling_params(**overrides)
    except InvalidSamplingParams as exc:
        raise from_engine_error(exc) from None
    except (TypeError, ValueError) as exc:
        raise ApiError("invalid_request", f"invalid sampling parameters: {exc}") from None
