"""The --help of every pagoda command shows each flag's default, so a user reads what runs."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, unless it has none to show (None, False) or the
    help already speaks of its default. argparse's own ArgumentDefaultsHelpFormatter prints
    "(default: None)" on every optional flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == [] or default == ""
                or default == argparse.SUPPRESS or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
