"""Errors of the HTTP gateway, and how each protocol writes them.

One exception, :class:`ApiError`, carries a protocol-neutral ``kind`` (and the HTTP status that goes
with it) and, where OpenAI defines one, a machine-readable ``code`` (``context_length_exceeded``,
``model_not_found``, ...); :func:`openai_body` and :func:`anthropic_body` render it in the shape each
API's clients parse. The protocol of a failing request is decided by its path (:func:`protocol_of`), so
even a request that fails before routing (bad key, unknown path) gets the shape its client expects.

Engine exceptions map here and nowhere else (:func:`from_engine_error`), so every endpoint reports
the same condition with the same status: a full queue is 429 everywhere, a closing engine 503.
"""

from __future__ import annotations

import re
from typing import Literal

from ninfer.contracts.errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineFailure,
    InvalidConstraintError,
    InvalidRequestError,
    InvalidSamplingParams,
    PromptTooLongError,
    QueueFullError,
    QueueTimeoutError,
)
from ninfer.errors import NInferError

Protocol = Literal["openai", "anthropic"]
Kind = Literal["invalid_request", "authentication", "not_found", "method_not_allowed", "too_large",
               "headers_too_large", "timeout", "rate_limit", "unavailable", "internal"]

STATUS: dict[str, int] = {
    "invalid_request": 400, "authentication": 401, "not_found": 404, "method_not_allowed": 405,
    "timeout": 408, "too_large": 413, "headers_too_large": 431, "rate_limit": 429, "internal": 500, "unavailable": 503,
}
_KIND_OF_STATUS = {v: k for k, v in STATUS.items()}

# The ``type`` OpenAI's API sends for each condition (a wrong key and an unknown model are invalid requests
# there too; a rate limit's type is what is limited, here requests). OpenAI has no request timeout of its
# own: "timeout_error" is this server's. Libraries branch on ``type`` and ``code``; the openai client picks
# its exception class by the status alone.
_OPENAI_TYPE = {
    "invalid_request": "invalid_request_error", "authentication": "invalid_request_error",
    "not_found": "invalid_request_error", "method_not_allowed": "invalid_request_error",
    "timeout": "timeout_error",
    "too_large": "invalid_request_error", "headers_too_large": "invalid_request_error", "rate_limit": "requests",
    "internal": "server_error",
    "unavailable": "server_error",
}
# OpenAI's ``code`` values this server sends; every other error has a null code, as most of OpenAI's do.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"   # how client libraries recognise context overflow
MODEL_NOT_FOUND = "model_not_found"
INVALID_API_KEY = "invalid_api_key"
RATE_LIMITED = "rate_limit_exceeded"
UNSUPPORTED_VALUE = "unsupported_value"

# vLLM's OpenAI server names the error after the exception class and puts the status in ``code``; with ``type``
# and ``code`` now OpenAI's, those two values are kept as ``status_type`` and ``status``.
_VLLM_TYPE = {
    "invalid_request": "BadRequestError", "authentication": "AuthenticationError", "not_found": "NotFoundError",
    "method_not_allowed": "MethodNotAllowedError", "timeout": "RequestTimeoutError",
    "too_large": "RequestTooLargeError", "headers_too_large": "RequestHeaderFieldsTooLargeError",
    "rate_limit": "RateLimitError", "internal": "InternalServerError",
    "unavailable": "ServiceUnavailableError",
}
# Anthropic's documented error types (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPE = {
    "invalid_request": "invalid_request_error", "authentication": "authentication_error",
    "not_found": "not_found_error", "method_not_allowed": "invalid_request_error",
    "timeout": "timeout_error", "too_large": "request_too_large", "headers_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "internal": "api_error", "unavailable": "overloaded_error",
}


class ApiError(Exception):
    """A request that cannot be served, with what the client should be told. ``param`` names the
    request field at fault (dotted path with list indices, e.g. ``messages[2].content``); ``code`` is
    OpenAI's machine-readable code of the condition (one of the constants above), or None."""

    def __init__(self, kind: Kind, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.message = message
        self.param = param
        self.code = code

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    @classmethod
    def for_status(cls, status: int, message: str) -> ApiError:
        kind = _KIND_OF_STATUS.get(status, "internal" if status >= 500 else "invalid_request")
        return cls(kind, message)  # type: ignore[arg-type]


def bad_request(message: str, param: str | None = None, *, code: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param, code=code)


class UnsupportedValue(ValueError):
    """Raised by a request model's validator for a value the API defines but this server cannot honour
    (``n`` > 1, ``suffix``, audio): the 400 then carries OpenAI's code ``unsupported_value``."""


# What the messages call the context limit, so an operator knows which server option raises it.
CONTEXT_SETTING = "the server's --max-context"


def context_length_error(message: str, param: str | None) -> ApiError:
    """The 400 of a request that does not fit the context; ``message`` names :data:`CONTEXT_SETTING`."""
    return bad_request(message, param=param, code=CONTEXT_LENGTH_EXCEEDED)


def protocol_of(path: str) -> Protocol:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def _text(s: str | None) -> str | None:
    # Messages may quote request text, which may hold lone surrogates that no JSON encoder can write: escaped.
    return None if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def openai_body(err: ApiError) -> dict:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (``code`` a string or null) plus vLLM's
    values: ``status`` (the HTTP status, vLLM's ``code``) and ``status_type`` (vLLM's ``type``)."""
    return {"error": {"message": _text(err.message), "type": _OPENAI_TYPE[err.kind], "param": _text(err.param),
                      "code": err.code, "status": err.status, "status_type": _VLLM_TYPE[err.kind]}}


def anthropic_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPE[err.kind], "message": _text(err.message)}}


def error_body(err: ApiError, protocol: Protocol) -> dict:
    return anthropic_body(err) if protocol == "anthropic" else openai_body(err)


_SAMPLING_FIELD = re.compile(r"invalid sampling parameter (\w+)=")


def from_engine_error(exc: BaseException, *, prompt_param: str = "messages", at_submit: bool = False,
                      constraint_param: str | None = None) -> ApiError:
    """The ApiError for an exception raised by ``Engine.submit`` (``at_submit``) or carried by a
    GenerationError. Any other NInferError raised synchronously by submit is about the request (the
    frontend refusing its output options, say): a 400; later it is the server's: a 500. A constraint that does
    not compile names ``constraint_param``, the field it came from."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return ApiError("rate_limit", f"the server is at capacity, retry later ({exc})", code=RATE_LIMITED)
    if isinstance(exc, QueueTimeoutError):
        return ApiError("rate_limit", f"the request waited too long for a free slot, retry later ({exc})",
                        code=RATE_LIMITED)
    if isinstance(exc, DeadlineExceededError):
        return ApiError("timeout", str(exc))
    if isinstance(exc, PromptTooLongError):
        return context_length_error(f"{exc} ({CONTEXT_SETTING})", prompt_param)
    if isinstance(exc, InvalidSamplingParams):
        m = _SAMPLING_FIELD.search(str(exc))
        return ApiError("invalid_request", str(exc), param=m.group(1) if m else None)
    if isinstance(exc, InvalidConstraintError):   # named in the message too: Anthropic's errors have no param
        where = f"{constraint_param}: " if constraint_param else ""
        return ApiError("invalid_request", f"{where}{exc}", param=constraint_param)
    if isinstance(exc, InvalidRequestError):
        return ApiError("invalid_request", str(exc))
    if isinstance(exc, EngineClosedError):
        return ApiError("unavailable", "the server is shutting down and accepts no requests")
    if isinstance(exc, EngineFailure):
        prefix = "the engine failed and accepts no requests: "
        return ApiError("unavailable", str(exc) if str(exc).startswith(prefix) else f"{prefix}{exc}")
    if isinstance(exc, NInferError) and at_submit:
        return ApiError("invalid_request", str(exc))
    if isinstance(exc, NInferError):
        return ApiError("internal", f"{type(exc).__name__}: {exc}")
    return ApiError("internal", "internal server error")
