"""Sandboxed chat-template rendering, compatible with HF ``apply_chat_template`` templates.

Templates come from artifacts (ultimately from model repositories): untrusted code. They run in
jinja2's ``ImmutableSandboxedEnvironment`` with the environment HF templates are written for:
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` filter that does not HTML-escape
(``ensure_ascii=False``, optional ``indent``/``separators``/``sort_keys``), and the ``raise_exception``
and ``strftime_now`` globals. Invariant: the same template and variables render the same text as HF.

The sandbox stops escapes, not work: nested loops over ``range(100000)`` or a doubly recursive macro would
render for hours. So every render has a budget of :data:`RENDER_STEPS` steps (each loop iteration and each
call counts one; the bundled template spends ~170 on a 40-message chat, and a doubly recursive macro spends the
whole budget in ~1 s), and ``*`` / ``**`` refuse results over :data:`MAX_PRODUCT` items (or, for ``**``, about
MAX_PRODUCT / 100 digits). Past either, the render stops with a ChatTemplateError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.models.common.qwen.errors import ChatTemplateError

BUNDLED_TEMPLATE = "qwen3_5.jinja"
# Loop iterations + calls one render may spend (module docstring).
RENDER_STEPS = 200_000
# Largest sequence ``*`` may build (items) and largest power ``**`` may form (decimal digits, roughly).
MAX_PRODUCT = 1_000_000
_LOOP_GUARD = "ninfer_loop_guard"


class _BudgetExceeded(Exception):
    pass


class _Budget:
    def __init__(self, steps: int) -> None:
        self.left = steps

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _BudgetExceeded


_RENDER_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _spend() -> None:
    budget = _RENDER_BUDGET.get()
    if budget is not None:
        budget.spend()


def _loop_guard(iterable: Iterable) -> Iterator:
    """Every ``{% for %}`` iterates through this (the templates' ASTs are rewritten at compile time)."""
    for item in iterable:
        _spend()
        yield item


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and loop iteration counted against the render's budget and ``*`` / ``**``
    bounded (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        _spend()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_PRODUCT:
                    raise jinja2.exceptions.SecurityError(f"a product of {len(seq)} x {n} items is over the "
                                                          f"sandbox's {MAX_PRODUCT:,}")
        elif (operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float))
              and abs(left) > 1 and right > 0 and right * len(str(int(abs(left)))) > MAX_PRODUCT // 100):
            raise jinja2.exceptions.SecurityError(f"the power {left!r} ** {right!r} is too large for the sandbox")
        return super().call_binop(context, operator, left, right)

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [loop.iter], [], None, None,
                                   lineno=loop.iter.lineno)
        return tree


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals[_LOOP_GUARD] = _loop_guard
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
        token = _RENDER_BUDGET.set(_Budget(RENDER_STEPS))
        try:
            return self._template.render(**variables)
        except _BudgetExceeded:
            raise ChatTemplateError(f"{self.origin}: the template ran past its budget of {RENDER_STEPS:,} steps "
                                    "(loop iterations and calls) for one render") from None
        except jinja2.TemplateError as exc:  # includes the template's own raise_exception
            raise ChatTemplateError(f"{self.origin}: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            # Malformed messages surface as Python errors inside the template; they are the request's fault.
            raise ChatTemplateError(f"{self.origin}: cannot render these messages: {exc!r}") from exc
        except (ArithmeticError, RecursionError) as exc:
            # The template itself (an artifact's may be anything): 1/0, a sandbox-refused range(10**9), a
            # recursive macro. Named, never a crash.
            raise ChatTemplateError(f"{self.origin}: the template failed: {exc!r}") from exc
        finally:
            _RENDER_BUDGET.reset(token)
