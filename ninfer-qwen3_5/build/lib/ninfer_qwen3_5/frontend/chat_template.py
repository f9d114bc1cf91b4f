"""Sandboxed chat-template rendering, compatible with HF ``apply_chat_template`` templates.

Templates come from artifacts (ultimately from model repositories): untrusted code. They run in
jinja2's ``ImmutableSandboxedEnvironment`` with the environment HF templates are written for:
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` filter that does not HTML-escape
(``ensure_ascii=False``, optional ``indent``/``separators``/``sort_keys``), and the ``raise_exception``
and ``strftime_now`` globals. Invariant: the same template and variables render the same text as HF.

The sandbox stops escapes, not work: nested loops over ``range(100000)`` or a doubly recursive macro would
render for hours. So every render has a budget of :data:`RENDER_STEPS` steps: each loop iteration (recursive
loops' inner levels included) and each call counts one; the bundled template spends ~6 per message (~170 on a
40-message chat). ``*``, ``+`` and ``**`` refuse sequences over :data:`MAX_PRODUCT` items and integers over
:data:`MAX_INT_DIGITS` digits, the output is capped at :data:`MAX_OUTPUT` characters, and jinja's ``lipsum``
global is gone. Past any of these the render stops with a ChatTemplateError naming it. What this does *not*
bound: the work of one step (a filter given a huge width, ``center``/``indent``/``format`` of 10**9 spaces, a sort
of a million items): a hostile artifact can still make one render slow or large; only a subprocess with time and
memory limits would bound that, and the artifact is the operator's choice, not the client's.
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
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer_qwen3_5.frontend.errors import ChatTemplateError

BUNDLED_TEMPLATE = "qwen3_5.jinja"
# Loop iterations + calls one render may spend (module docstring).
RENDER_STEPS = 200_000
# Largest sequence ``*`` / ``+`` may build (items), largest integer ``*`` / ``**`` may form (decimal digits), and
# the most characters one render may output.
MAX_PRODUCT = 1_000_000
MAX_INT_DIGITS = 10_000
MAX_OUTPUT = 64 << 20
# The filter every {% for %} iterable is passed through: a filter, so no template variable can shadow it.
_LOOP_GUARD = "ninfer_loop_guard"
_LOG10_2 = 0.30103


class _BudgetExceeded(Exception):
    """A render spent its step budget; ChatTemplate.render turns it into a ChatTemplateError naming the budget."""


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
    """Every ``{% for %}`` iterates through this (the parsed template is rewritten before compiling)."""
    for item in iterable:
        _spend()
        yield item


def _int_digits(n: int) -> float:
    """About the decimal digits of ``n`` (a lower bound within one digit: log10 of its highest power of two)."""
    return max(abs(n).bit_length() - 1, 0) * _LOG10_2


def _refuse_growth(operator: str, left: Any, right: Any) -> None:
    """SecurityError when ``left <operator> right`` would build a sequence or an integer past the limits."""
    why = None
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if (isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 1
                    and len(seq) * n > MAX_PRODUCT):
                why = f"a product of {len(seq)} x {n} items is over the sandbox's {MAX_PRODUCT:,}"
        if isinstance(left, int) and isinstance(right, int) and _int_digits(left) + _int_digits(right) > MAX_INT_DIGITS:
            why = f"an integer product over {MAX_INT_DIGITS:,} digits"
    elif operator == "+":
        if (isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple))
                and len(left) + len(right) > MAX_PRODUCT):
            why = f"a sum of {len(left)} + {len(right)} items is over the sandbox's {MAX_PRODUCT:,}"
    elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 1
          and _int_digits(left) * right > MAX_INT_DIGITS):
        why = f"an integer power over {MAX_INT_DIGITS:,} digits"
    if why is not None:
        raise jinja2.exceptions.SecurityError(why)


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and loop iteration counted against the render's budget and ``*`` / ``+`` /
    ``**`` bounded (see the module docstring)."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        _spend()
        if isinstance(__obj, LoopContext) and args:
            # loop(children) of a recursive loop: its iterations are counted like the outer loop's.
            args = (_loop_guard(args[0]), *args[1:])
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _refuse_growth(operator, left, right)
        return super().call_binop(context, operator, left, right)


def _guard_loops(tree: nodes.Template) -> nodes.Template:
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, _LOOP_GUARD, [], [], None, None, lineno=loop.iter.lineno)
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
    env.filters[_LOOP_GUARD] = _loop_guard
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals.pop("lipsum", None)   # lipsum(10**8): a gigabyte in one call, and no chat template uses it
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
            env = _environment()
            self._template = env.from_string(_guard_loops(env.parse(source)))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin}: does not compile: {exc}") from exc

    def render(self, **variables: Any) -> str:
        token = _RENDER_BUDGET.set(_Budget(RENDER_STEPS))
        try:
            out, size = [], 0
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > MAX_OUTPUT:
                    raise ChatTemplateError(f"{self.origin}: the template's output ran past {MAX_OUTPUT:,} "
                                            "characters")
                out.append(chunk)
            return "".join(out)
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
