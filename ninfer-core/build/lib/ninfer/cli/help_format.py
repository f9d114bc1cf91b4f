"""The ``--help`` layout of every ``ninfer`` parser: each option shows its default.

A default is appended as ``(default: VALUE)`` unless the help text already says its default in words (a
default that depends on the device or the model, or one read from the environment, which ``--help`` must not
print) or there is nothing to show (None, False, an empty list).
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter plus each option's default (see the module docstring)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default == []
                or default is argparse.SUPPRESS or not action.option_strings):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"
