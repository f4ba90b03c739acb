"""One-line errors of the ``nsa-backend`` commands: the classes of :mod:`nsa_backend_cli.errors`.

They are defined in the launcher package, which imports only the standard library, so that the
parser (and ``--help`` / ``--version``) never imports ``nsa_backend`` and torch; the commands in
this package raise the very same :class:`CliError` that the launcher's ``main`` catches.
"""

from __future__ import annotations

from nsa_backend_cli.errors import EXIT_INVALID, EXIT_OK, EXIT_USAGE, CliError, Parser, int_in_range, one_of

__all__ = ["EXIT_INVALID", "EXIT_OK", "EXIT_USAGE", "CliError", "Parser", "int_in_range", "one_of"]
