"""Reading a request body into a protocol model: malformed JSON and schema violations become 400s
that name the problem (the JSON error position, or the field path and what is wrong with it).

Unknown fields: like vLLM's OpenAI server, the protocol models accept fields they do not define and
ignore them, logging a warning that names them (a client sending a newer API's field keeps working).
Fields the APIs define but this server cannot honour are declared in the models and rejected there
with a message naming them (an :class:`~ninfer_serve.errors.UnsupportedValue`, so the OpenAI body's
``code`` is ``unsupported_value``), so nothing a client relies on is silently dropped.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ninfer_serve.errors import UNSUPPORTED_VALUE, UnsupportedValue, bad_request

log = logging.getLogger("ninfer.serve")

M = TypeVar("M", bound=BaseModel)

# Union members and validators show up in pydantic's error locations under type names; a client only
# cares about the field path.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before",
              "function-plain", "function-wrap", "literal", "tagged-union", "union"}


def _message(error: dict) -> str:
    if error["type"] == "model_type":   # "... instance of NamedToolChoice": the class name means nothing to a client
        return "Input should be an object"
    return error["msg"].removeprefix("Value error, ")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"malformed JSON body: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise bad_request("malformed JSON body: the body is empty")
    try:
        # NaN/Infinity are not JSON; Python's parser would accept them and they would reach sampling.
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None


# A union member named by its model class (``tool_choice.NamedToolChoice``): request fields are snake_case.
_MODEL_TAG = re.compile(r"[A-Z][A-Za-z0-9]*")


def field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("function-")
                                        or _MODEL_TAG.fullmatch(part)):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def validate(model: type[M], raw: bytes) -> M:
    """Parse ``raw`` as ``model``; raise a 400 ApiError naming the first bad field."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # The most specific location is the most useful one. A union reports one error per member at the same
        # field: those are alternatives, joined into one message (each member's expectation), not "more problems".
        first = max(errors, key=lambda e: len(field_path(e["loc"])))
        path = field_path(first["loc"]) or None
        same = [e for e in errors if (field_path(e["loc"]) or None) == path]
        msgs = list(dict.fromkeys(_message(e) for e in same))
        others = len(errors) - len(same)
        more = f" (and {others} more problems)" if others else ""
        where = f"field '{path}'" if path else "request body"
        code = UNSUPPORTED_VALUE if isinstance(first.get("ctx", {}).get("error"), UnsupportedValue) else None
        raise bad_request(f"invalid {where}: {'; or: '.join(msgs)}{more}", param=path, code=code) from None
    extra = sorted(set(parsed.model_extra or ()) - getattr(model, "READ_FROM_EXTRA", frozenset()))
    if extra:
        log.warning("%s: ignoring unknown request fields %s", model.__name__, ", ".join(extra))
    return parsed
