"""On/off switches read from the environment: ``"1"`` on, ``"0"`` off, unset or blank the default, and any other
value an error that names the variable (a typo must not silently pick a code path)."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool, *, error: type[Exception] = ValueError, meaning: str = "") -> bool:
    """Whether the switch ``name`` is on (``default`` when unset or blank); ``error`` naming the variable and the
    value, with ``meaning`` (what 1 and 0 do) when given, for anything but 0 or 1."""
    raw = os.environ.get(name, "").strip() or ("1" if default else "0")
    if raw not in ("0", "1"):
        raise error(f"{name}={raw!r}: expected 0 or 1" + (f" ({meaning})" if meaning else ""))
    return raw == "1"
