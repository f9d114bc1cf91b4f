"""Sandboxed chat-template rendering, compatible with HF ``apply_chat_template`` templates.

Templates come from artifacts (ultimately from model repositories): untrusted code. They run in
jinja2's ``ImmutableSandboxedEnvironment`` with the environment HF templates are written for:
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` filter that does not HTML-escape
(``ensure_ascii=False``, optional ``indent``/``separators``/``sort_keys``), and the ``raise_exception``
and ``strftime_now`` globals. Invariant: the same template and variables render the same text as HF.
"""

from __future__ import annotations

import json
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.models.common.qwen.errors import ChatTemplateError

BUNDLED_TEMPLATE = "qwen3_5.jinja"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def bundled_template_source(name: str = BUNDLED_TEMPLATE) -> str:
    """NInfer's own template shipped in this package (``templates/``)."""
    return resources.files(__package__).joinpath("templates").joinpath(name).read_text(encoding="utf-8")


class ChatTemplate:
    """A compiled template; immutable, reentrant."""

    def __init__(self, source: str, origin: str = "chat template"):
        self.source = source
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin}: does not compile: {exc}") from exc

    def render(self, **variables: Any) -> str:
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:  # includes the template's own raise_exception
            raise ChatTemplateError(f"{self.origin}: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            # Malformed messages surface as Python errors inside the template; they are the request's fault.
            raise ChatTemplateError(f"{self.origin}: cannot render these messages: {exc!r}") from exc
        except (ArithmeticError, RecursionError) as exc:
            # The template itself (an artifact's may be anything): 1/0, a sandbox-refused range(10**9), a
            # recursive macro. Named, never a crash.
            raise ChatTemplateError(f"{self.origin}: the template failed: {exc!r}") from exc
