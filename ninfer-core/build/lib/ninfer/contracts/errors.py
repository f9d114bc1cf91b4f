"""The two failure classes of the engine (docs/design.md section 5).

- :class:`RequestRejected`: one request cannot be served (overload, queue timeout, deadline, input too
  long, engine closed). The engine keeps running; only that request sees the error.
- :class:`EngineFailure`: an engine invariant broke (a PendingBatch rule, a Program call that could
  not commit, a worker crash). The engine stops accepting and every in-flight request receives it.
  Internal corruption is never downgraded to a request-level error.

``InvalidSamplingParams`` (in :mod:`ninfer.contracts.sampling`) is the rejection for bad
sampling values; it predates this module and is re-exported here for one-stop imports.
"""

from __future__ import annotations

from ninfer.contracts.sampling import InvalidSamplingParams
from ninfer.errors import NInferError


class RequestRejected(NInferError):
    """A request-level rejection: the engine is healthy, this request is not served (further)."""


class InvalidRequestError(RequestRejected):
    """The request cannot be represented (empty prompt, token id outside the vocabulary, ...)."""


class QueueFullError(RequestRejected):
    """Overload: the engine's outstanding capacity (running + waiting + unreleased) is exhausted."""


class QueueTimeoutError(RequestRejected):
    """The request waited in the admission queue longer than ``EngineOptions.queue_timeout_s``."""


class DeadlineExceededError(RequestRejected):
    """The request's deadline passed before it was admitted."""


class PromptTooLongError(RequestRejected):
    """The prompt leaves no room for one output token within ``max_context``."""


class InvalidConstraintError(InvalidRequestError):
    """The request's output constraint (grammar, JSON schema, regex, choice, tools) cannot be compiled
    or is not supported; the message names the problem. Raised on the submitting thread."""


class EngineClosedError(RequestRejected):
    """The engine was closed (or is closing) before the request could finish."""


class EngineFailure(NInferError):
    """An engine-level failure: an invariant broke. The engine no longer accepts requests."""


# Everything a caller should treat as "this request was refused"; InvalidSamplingParams predates
# RequestRejected and keeps its own base class.
REJECTIONS: tuple[type[NInferError], ...] = (RequestRejected, InvalidSamplingParams)

__all__ = [
    "REJECTIONS",
    "DeadlineExceededError", "EngineClosedError", "EngineFailure", "InvalidConstraintError", "InvalidRequestError",
    "InvalidSamplingParams", "PromptTooLongError", "QueueFullError", "QueueTimeoutError",
    "RequestRejected",
]
