"""The Python API's argument checks, on the caller's thread, before anything is queued.

``Engine.start``, ``submit`` / ``generate`` and ``chat`` take plain Python values; a wrong kind of value must be
refused here, naming the argument, and never reach the engine worker (where it would fail a whole step and every
request in it) or be silently read as something else (a truthy string, bytes as token ids, a dict of tools
rendered into the prompt as text). The contracts check their own fields (``ninfer.contracts.field_types``); these
are the checks of the API's own keywords and prompt forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.contracts.errors import InvalidRequestError
from ninfer.contracts.field_types import type_problem
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.options import EngineOptions


def looks_like_messages(prompt: Any) -> bool:
    """A chat message (a mapping) or a sequence holding one, where a prompt was expected."""
    if isinstance(prompt, Mapping):
        return True
    return (isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes))
            and any(isinstance(item, Mapping) for item in prompt))


def options_with(options: Any, overrides: Mapping[str, Any]) -> EngineOptions:
    if options is not None and not isinstance(options, EngineOptions):
        raise TypeError(f"options must be an EngineOptions (or give its fields as keywords, e.g. max_context=8192), "
                        f"got {type(options).__name__}")
    return dataclasses.replace(options or EngineOptions(), **overrides).validate()


def check_chat(messages: Any, tools: Any, enable_thinking: Any, template_kwargs: Any) -> None:
    """``Engine.chat``'s arguments: a message list, function specs, a flag and a mapping."""
    check_messages(messages)
    check_tools(tools)
    if not isinstance(enable_thinking, bool):
        raise TypeError(f"enable_thinking must be True or False, got {type(enable_thinking).__name__} "
                        f"{enable_thinking!r:.40}")
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise TypeError(f"template_kwargs must be a mapping, got {type(template_kwargs).__name__}")


def check_tools(tools: Any) -> None:
    """Function specs as the chat templates render them: ``{"type": "function", "function": {"name": ...}}`` or
    the bare ``{"name": ...}``; anything else would be rendered into the prompt as text."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of function specs, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tool {i} must be a mapping such as {{'type': 'function', 'function': "
                                      f"{{'name': ..., 'parameters': {{...}}}}}} with a non-empty name, got {tool!r:.80}")


def check_request_keywords(output, deadline, timeout_s) -> None:
    """The keywords used before the GenerationRequest exists (which checks its own fields): ``output``, and the
    deadline and timeout the submit combines."""
    if output is not None and not isinstance(output, OutputOptions):
        raise TypeError(f"output must be an OutputOptions (e.g. OutputOptions(stop=('###',))), got "
                        f"{type(output).__name__}")
    for name, value in (("deadline", deadline), ("timeout_s", timeout_s)):
        why = type_problem(value, "float | None")
        if why is not None:
            raise TypeError(f"{name} (seconds) {why}")
    if timeout_s is not None and not timeout_s > 0:
        raise InvalidRequestError(f"timeout_s must be > 0, got {timeout_s!r}")


def token_ids_of_array(array: Any) -> list:
    """The token ids of a 1-D integer array (numpy, torch) as Python ints; anything else is named."""
    dtype = str(getattr(array, "dtype", ""))
    shape = tuple(getattr(array, "shape", ()))
    if len(shape) != 1 or "int" not in dtype:
        raise InvalidRequestError(f"a prompt given as an array must be a 1-D array of integer token ids, got "
                                  f"{type(array).__name__} of dtype {dtype or '?'} and shape {shape}")
    return [int(t) for t in array.tolist()]


def check_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)):
        raise InvalidRequestError("chat() takes a list of messages such as [{'role': 'user', 'content': 'Hi'}]; "
                                  "a plain text prompt goes to generate()")
    if isinstance(messages, Mapping) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(f"chat() takes a non-empty list of messages such as "
                                  f"[{{'role': 'user', 'content': 'Hi'}}], got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidRequestError(f"message {i} must be a mapping with a 'role' (and 'content'), got {m!r:.80}")
