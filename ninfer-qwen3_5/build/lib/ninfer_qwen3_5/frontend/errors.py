"""Errors of the Qwen frontend. Each message names the resource, field or template at fault."""

from __future__ import annotations

from ninfer.errors import NInferError


class FrontendError(NInferError):
    """A frontend resource (tokenizer, template, generation config) is missing or malformed, or a
    request asks for output interpretation the frontend cannot do."""


class ChatTemplateError(FrontendError):
    """The chat template failed to compile or render (including ``raise_exception`` in the template).
    Raised for the request's messages, so a gateway reports it as a bad request."""
