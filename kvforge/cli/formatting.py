"""Help that states every default, and the package version for `kvforge --version`."""
from __future__ import annotations

import argparse

FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction, argparse._VersionAction,
                argparse._SubParsersAction, argparse.BooleanOptionalAction)


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or isinstance(action, FLAG_ACTIONS) or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def apply_formatter(parser: argparse.ArgumentParser) -> None:
    """Give this parser and every subcommand's parser the defaults-stating help."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_formatter(sub)


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += all_parsers(sub)
    return found


class VersionAction(argparse._VersionAction):
    """`--version`: the package version, derived only when asked (in a checkout it runs git)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from kvforge.version import package_version

        self.version = f"kvforge {package_version()}"
        super().__call__(parser, namespace, values, option_string)
