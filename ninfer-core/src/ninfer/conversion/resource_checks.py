"""Checks of the ``text`` component's resources: a broken one is refused before anything is written.

Each check mirrors how a frontend loads the Hugging Face resource (the ``tokenizers`` library, JSON configs,
a sandboxed Jinja chat template) and is no stricter than that:

- ``tokenizer.json``: UTF-8 text that ``tokenizers.Tokenizer.from_str`` loads;
- ``tokenizer_config.json``, ``generation_config.json``: JSON (``json.loads`` of the bytes) holding an
  object; the fields the runtime reads have the types it needs: the sampling values of
  ``generation_config.json`` (when not null) are numbers in the engine's ranges (``SamplingParams.validate``:
  a default out of range would fail every request that does not override it), its ``eos_token_id`` an id or a
  list of ids,
  ``tokenizer_config.json``'s ``eos_token`` a string (or ``{"content": string}``); with a tokenizer in the
  folder, those ids and tokens must be in its vocabulary;
- the chat template the runtime would compile (``chat_template.jinja``, stored or derived, else the
  ``default`` entry of a named-template list in ``tokenizer_config.json``): UTF-8 text that compiles in
  the runtime's sandboxed Jinja environment. Only compiled, never rendered.

Every failure is a :class:`~ninfer.conversion.errors.SourceError` with a one-line message naming the file.
Vision resources are stored unchecked (no runtime reads them yet).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ninfer.contracts.errors import InvalidSamplingParams
from ninfer.contracts.sampling import SamplingParams
from ninfer.conversion.errors import SourceError

if TYPE_CHECKING:
    from ninfer.conversion.resources import Resource

# Read by the frontends from generation_config.json as numbers (the request sampling defaults).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


def check_text_resources(resources: Sequence[Resource], folder: Path) -> None:
    """Check the ``text`` resources among ``resources`` of the source ``folder``; raise
    :class:`SourceError` naming the first broken one."""
    text = {r.role: r for r in resources if r.component == "text"}
    tokenizer = None
    if "tokenizer.json" in text:
        tokenizer = _check_tokenizer(text["tokenizer.json"], folder)
    tokenizer_config = None
    if "tokenizer_config.json" in text:
        tokenizer_config = _json_object(text["tokenizer_config.json"], folder)
        _check_eos_token(tokenizer_config, _where(text["tokenizer_config.json"], folder), tokenizer)
    if "generation_config.json" in text:
        gen = _json_object(text["generation_config.json"], folder)
        _check_generation_config(gen, _where(text["generation_config.json"], folder), tokenizer)
    if "chat_template.jinja" in text:
        res = text["chat_template.jinja"]
        where = _where(res, folder)
        try:
            source = res.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError(f"{where} is not UTF-8 text: {_one_line(exc)}") from None
        _check_template(source, where)
    elif tokenizer_config is not None and isinstance(tokenizer_config.get("chat_template"), list):
        # The named-templates form stays inside tokenizer_config.json; the runtime compiles its "default".
        default = next((t.get("template") for t in tokenizer_config["chat_template"]
                        if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(default, str):
            _check_template(default, f"the 'default' chat_template of {_where(text['tokenizer_config.json'], folder)}")


def check_frontend_loads(registry: Any, text_config: Mapping[str, Any], resources: Sequence[Resource]) -> None:
    """Build the frontend the runtime would build for the ``text`` component (its architecture's frontend family,
    over these resources and the model's vocabulary size), when the installed plugins provide both; a failure
    (no tokenizer.json, a vocabulary smaller than the tokenizer's ids, ...) is a :class:`SourceError`, so an
    artifact that converts also loads. Without the runtime plugin nothing is checked: conversion needs only the
    source mapping. A folder without ``tokenizer.json`` is not checked either (weights-only test checkpoints
    convert); the converter warns that such an artifact cannot start an engine."""
    from ninfer.contracts.features import StartupFeatures
    from ninfer.errors import NInferError

    if not any(r.component == "text" and r.role == "tokenizer.json" for r in resources):
        return
    names = text_config.get("architectures")
    spec = registry.architectures.get(names[0]) if isinstance(names, list) and names else None
    family = registry.frontends.get(spec.frontend) if spec is not None else None
    if family is None:
        return
    try:
        vocab_size = spec.profile(text_config, StartupFeatures()).vocab_size
        family.create({r.role: r.read() for r in resources if r.component == "text"}, vocab_size)
    except NInferError as exc:
        raise SourceError(f"the converted model would not load: the {spec.frontend!r} frontend refuses its text "
                          f"resources: {_one_line(exc)}") from None


def _where(res: Resource, folder: Path) -> str:
    """The source file a resource comes from, as messages name it."""
    if res.path is not None:
        return f"resource file {str(res.path)!r}"
    return f"the chat_template of {str(folder / str(res.derived_from))!r}"


def _one_line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())


def _check_tokenizer(res: Resource, folder: Path) -> Tokenizer:
    where = _where(res, folder)
    try:
        text = res.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{where} is not UTF-8 text: {_one_line(exc)}") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed tokenizer
        raise SourceError(f"{where} is not a tokenizer the tokenizers library can load: {_one_line(exc)}") from None


def _json_object(res: Resource, folder: Path) -> dict[str, Any]:
    where = _where(res, folder)
    try:
        value = json.loads(res.read())  # as the runtime reads it: bytes, UTF-8 detected by json
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise SourceError(f"{where} is not valid JSON: {_one_line(exc)}") from None
    except RecursionError:
        raise SourceError(f"{where} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise SourceError(f"{where} must hold a JSON object, not {_json_kind(value)}")
    return value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}.get(
        type(value), type(value).__name__)


def _check_eos_token(config: Mapping[str, Any], where: str, tokenizer: Tokenizer | None) -> None:
    token = config.get("eos_token")
    if isinstance(token, Mapping):  # the AddedToken dict form
        token = token.get("content")
    if token is None:
        return
    if not isinstance(token, str):
        raise SourceError(f"{where}: eos_token {token!r} is not a string")
    if tokenizer is not None and tokenizer.token_to_id(token) is None:
        raise SourceError(f"{where}: eos_token {token!r} is not in the vocabulary of tokenizer.json")


def _check_generation_config(gen: Mapping[str, Any], where: str, tokenizer: Tokenizer | None) -> None:
    for key in SAMPLING_KEYS:
        value = gen.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SourceError(f"{where}: {key}={value!r} is not a number")
    # The engine's own ranges (SamplingParams.validate): a default out of range would fail every later request that
    # does not override it, far from this file.
    values = {k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None}
    top_k = values.get("top_k")
    if top_k is not None and top_k != int(top_k):
        raise SourceError(f"{where}: top_k={top_k!r} is not an integer")
    if top_k is not None:
        values["top_k"] = int(top_k)
    try:
        SamplingParams(**values).validate()
    except InvalidSamplingParams as exc:
        raise SourceError(f"{where}: {exc}") from None
    raw = gen.get("eos_token_id")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else None
    for value in (raw if isinstance(raw, list) else [] if raw is None else [raw]):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SourceError(f"{where}: eos_token_id {value!r} is not a token id (an integer >= 0)")
        if vocab is not None and value >= vocab:
            raise SourceError(f"{where}: eos_token_id {value} is outside the vocabulary of tokenizer.json "
                              f"({vocab} tokens)")


def _environment() -> ImmutableSandboxedEnvironment:
    """The chat-template environment of Hugging Face checkpoints as far as compiling goes: the sandbox, options
    and extension a frontend renders with (a frontend may add render-time budgets, filters and globals, which
    only matter when rendering)."""
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])


def _check_template(source: str, where: str) -> None:
    try:
        _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise SourceError(f"{where} is not a valid Jinja template: line {exc.lineno}: {_one_line(exc.message or '')}"
                          ) from None
    except jinja2.TemplateError as exc:
        raise SourceError(f"{where} is not a valid Jinja template: {_one_line(exc)}") from None
