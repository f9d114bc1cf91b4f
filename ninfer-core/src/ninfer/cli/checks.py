"""Checks of command-line values that need no model, and the output-budget rule that needs its context.

Every numeric flag is checked before the model is resolved, converted or loaded, so a typo costs no load: the
error names the flag and the rule (the engine's own validation, so the CLI and the Python API agree). The
output budget follows the HTTP server (``ninfer_serve.sampling.output_budget``): an explicit ``--max-tokens``
must fit the context left after the prompt, else the command fails naming both numbers instead of silently
generating fewer tokens.
"""

from __future__ import annotations

import argparse
from typing import Any

from ninfer.errors import NInferError

# flag dest -> the engine field it sets (SamplingParams or EngineOptions)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed")
ENGINE_FIELDS = ("max_concurrency", "max_context", "num_pages", "prefill_chunk_size", "max_step_tokens", "max_encode_rows")


class OutputBudgetError(NInferError):
    """--max-tokens does not fit the context left after the prompt."""


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Each sampling flag given, checked alone by ``SamplingParams.validate``; raises an NInferError naming it."""
    from ninfer.contracts.sampling import SamplingParams

    for dest in SAMPLING_FIELDS:
        value = getattr(args, dest, None)
        if value is not None:
            _check(dest, value, lambda v, d=dest: SamplingParams(**{d: v}).validate())


def check_engine_flags(args: argparse.Namespace, fields: tuple[str, ...] = ENGINE_FIELDS) -> None:
    """Each engine flag of ``fields`` given, checked alone by ``EngineOptions.validate``; raises an NInferError
    naming it."""
    from ninfer.contracts.options import EngineOptions

    for dest in fields:
        value = getattr(args, dest, None)
        if value is not None:
            _check(dest, value, lambda v, d=dest: EngineOptions(**{d: v}).validate())


def speculative_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineOptions fields of ``--speculative`` (``none``: off) and ``--num-speculative-tokens``, checked
    like the engine checks them (``EngineOptions.validate``, then the registered backends:
    ``ninfer.planning.resolution.check_speculative``); raises an NInferError naming the flag."""
    from ninfer.contracts.options import EngineOptions
    from ninfer.planning.resolution import check_speculative

    name = getattr(args, "speculative", None)
    name = None if name is None or name.strip().lower() == "none" else name
    k = getattr(args, "num_speculative_tokens", None)
    if k is not None:
        _check("num_speculative_tokens", k,
               lambda v: EngineOptions(speculative=name or "any", num_speculative_tokens=v).validate())
        if name is None:
            raise NInferError(f"{flag_name('num_speculative_tokens')} {k}: needs --speculative NAME (without a "
                              f"backend nothing is drafted)")
    if name is None:
        return {}
    _check("speculative", name, lambda v: check_speculative(EngineOptions(speculative=v, num_speculative_tokens=k)))
    return {"speculative": name, "num_speculative_tokens": k}


def _check(dest: str, value: Any, validate) -> None:
    try:
        validate(value)
    except NInferError as exc:
        raise type(exc)(f"{flag_name(dest)} {value}: {exc}") from None


def output_budget(requested: int | None, default: int, *, prompt_tokens: int, max_context: int) -> int:
    """The output budget of one request: ``requested`` (an explicit --max-tokens) if it fits the context left
    after the prompt, else an OutputBudgetError naming both numbers (the HTTP server's rule and wording);
    without one, ``default`` lowered to that room, as a request without max_tokens over HTTP takes the room.
    A prompt that leaves no room at all is the engine's PromptTooLongError at submit, so it passes here."""
    room = max_context - prompt_tokens
    if room < 1:
        return requested if requested is not None else default
    if requested is None:
        return min(default, room)
    if requested > room:
        raise OutputBudgetError(f"--max-tokens is too large: {requested}. This model's maximum context length is "
                                f"{max_context} tokens and the prompt has {prompt_tokens} tokens "
                                f"({requested} > {max_context} - {prompt_tokens})")
    return requested


def check_max_tokens_fits(requested: int | None, *, max_context: int) -> None:
    """An explicit --max-tokens that no prompt (at least one token) leaves room for: an OutputBudgetError."""
    if requested is not None and requested > max_context - 1:
        raise OutputBudgetError(f"--max-tokens is too large: {requested}. This model's maximum context length is "
                                f"{max_context} tokens and a prompt has at least 1 token "
                                f"({requested} > {max_context} - 1)")
