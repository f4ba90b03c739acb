"""``python -m nsa_backend.cli``: the ``nsa-backend`` command, run as a module of the package.

The command lives in the launcher package :mod:`nsa_backend_cli` (the console script's entry point),
which builds the parser without importing ``nsa_backend``; this module re-exports it so that
``python -m nsa_backend.cli doctor`` and ``from nsa_backend.cli import main`` keep working. Run this
way, the package (torch, the custom ops) is imported before the parser is built.
"""

from __future__ import annotations

from nsa_backend_cli import ARCH_FAMILIES, COMMANDS, KV_CACHE_DTYPES, build_parser, main, version

__all__ = ["ARCH_FAMILIES", "COMMANDS", "KV_CACHE_DTYPES", "build_parser", "main", "version"]

if __name__ == "__main__":
    raise SystemExit(main())
