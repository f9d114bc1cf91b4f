"""Type checks of a frozen contract's fields against their annotations, for the values a Python caller passes.

The contracts (SamplingParams, OutputOptions, EngineOptions) are plain dataclasses, so nothing stops
``max_tokens=1e3`` or ``ignore_eos="no"`` from reaching the engine worker, where a float slice index or a truthy
string fails a whole step, or silently means something else. Their ``validate`` (or ``__post_init__``) calls
:func:`type_problem` on every field first, on the submitting thread, and refuses the value naming the field.

:func:`normalize_fields` first turns the values that stand for the annotated type into it (a ``numpy`` integer
into an ``int``, a ``numpy.float32`` or ``Fraction`` into a ``float``, a ``torch.device`` into its name, a list
into a tuple), so the worker only ever meets Python's own types. Invariants of :func:`type_problem`, by annotation
(the annotation strings of ``from __future__ import annotations``):

- ``bool``: ``True`` or ``False`` only (no 0/1, no strings);
- ``int``: an ``int`` that is not a ``bool`` (no ``1e3``, no ``5.0``);
- ``float``: an ``int`` or ``float`` that is not a ``bool`` (``Decimal`` and strings are refused);
- ``str``: a ``str``;
- ``tuple[T, ...]`` with T one of the above: a tuple (or list) whose items each fit T;
- ``X | None``: None, or what X accepts;
- any other annotation is not checked here (the contract checks it itself).
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import fields
from typing import Any


def _scalar(value: Any, name: str) -> str | None:
    if name == "bool":
        return None if isinstance(value, bool) else "must be True or False"
    if name == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if name == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if name == "str":
        return None if isinstance(value, str) else "must be a string"
    return None


_SCALARS = ("bool", "int", "float", "str")


def type_problem(value: Any, annotation: str) -> str | None:
    """None when ``value`` fits ``annotation`` (module docstring), else what it must be, e.g. ``"must be an
    integer, not float"``."""
    parts = [p.strip() for p in annotation.split("|")]
    if "None" in parts:
        if value is None:
            return None
        parts.remove("None")
    if len(parts) != 1:
        return None
    name = parts[0]
    if name in _SCALARS:
        why = _scalar(value, name)
    elif name.startswith("tuple[") and name.endswith(", ...]") and name[6:-6] in _SCALARS:
        item = name[6:-6]
        if not isinstance(value, (tuple, list)):
            why = f"must be a sequence of {item} values (a tuple or list)"
        else:
            bad = next((v for v in value if _scalar(v, item) is not None), _NONE)
            if bad is _NONE:
                return None
            return f"every item {_scalar(bad, item)}, not {type(bad).__name__} ({bad!r})"
    else:
        return None
    if why is None:
        return None
    if "None" in annotation:
        why = "must be True, False or None" if name == "bool" else f"{why} or None"
    return f"{why}, not {type(value).__name__}"


_NONE = object()


def _normal(value: Any, name: str) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if name == "int" and not isinstance(value, int) and hasattr(value, "__index__"):
        return operator.index(value)
    if name == "float" and not isinstance(value, (int, float)) and isinstance(value, numbers.Real):
        return float(value)
    if name == "str" and type(value).__module__ == "torch" and type(value).__name__ == "device":
        return str(value)
    return value


def normalized(value: Any, annotation: str) -> Any:
    """``value`` as the annotated Python type when it stands for one (module docstring), else unchanged."""
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    if len(parts) != 1:
        return value
    name = parts[0]
    if name.startswith("tuple[") and name.endswith(", ...]"):
        if isinstance(value, list):
            value = tuple(value)
        return tuple(_normal(v, name[6:-6]) for v in value) if isinstance(value, tuple) else value
    return _normal(value, name)


def normalize_fields(obj: Any) -> None:
    """Normalize every field of the frozen dataclass ``obj`` in place (``__post_init__`` only)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        new = normalized(value, f.type)
        if new is not value:
            object.__setattr__(obj, f.name, new)
