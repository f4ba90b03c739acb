"""``python -m nsa_backend.bench``: the ``nsa-backend bench`` command."""

from nsa_backend.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
