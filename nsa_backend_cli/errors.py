"""One-line errors of the ``nsa-backend`` command line.

Every bad input of a subcommand (a flag, the config file, an environment variable) ends the command
with exactly one line on stderr, ``error: <what>: <why>``, where ``<what>`` names the flag, file,
key or variable and ``<why>`` says what was expected (the accepted values where there is a list),
and exit status 2. Only the standard library is imported here: the launcher builds its parser with
these classes before (and, for ``--help`` / ``--version``, without) importing ``nsa_backend``; the
commands raise the same :class:`CliError` through :mod:`nsa_backend._cli_errors`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import NoReturn

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A bad input, reported as ``error: <what>: <why>``.

    Parameters
    ----------
    what : str
        The flag, file, config key or environment variable at fault (``"--tp 3"``, a path); or the
        whole message when a library error already starts with it (a config file's path).
    why : str
        What is wrong and what is accepted (empty when ``what`` is the whole message).
    status : int
        Exit status: 2 for usage and configuration errors (the default), 1 for an implementation
        choice that cannot run (``plan``).
    """

    def __init__(self, what: str, why: str = "", status: int = EXIT_USAGE):
        super().__init__(f"{what}: {why}" if why else what)
        self.what = what
        self.why = why
        self.status = status

    def line(self) -> str:
        """The message as one line (newlines of wrapped library messages folded into spaces)."""
        return "error: " + " ".join(str(self).split())


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line ``error: <prog>: <message>`` and status 2 (argparse
    prints a usage block first); sub-parsers made by ``add_subparsers`` inherit the class. Like
    argparse, a parse error exits (``SystemExit(2)``)."""

    def error(self, message: str) -> NoReturn:
        print(CliError(self.prog, message).line(), file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def int_in_range(flag: str, value: int, low: int, high: int | None = None, why: str = "") -> int:
    """Return ``value`` when ``low <= value <= high`` (``high=None``: no upper bound), else raise
    :class:`CliError` naming ``flag`` and the accepted range (``why`` adds the reason of a bound)."""
    if value < low or (high is not None and value > high):
        accepted = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise CliError(f"{flag} {value}", f"expected {accepted}{f' ({why})' if why else ''}")
    return value


def one_of(flag: str, value: str, accepted: Iterable[str]) -> str:
    """Return ``value`` when it is in ``accepted``, else raise :class:`CliError` listing them."""
    choices = list(accepted)
    if value not in choices:
        raise CliError(f"{flag} {value}", f"unknown value; accepted values: {', '.join(choices)}")
    return value
