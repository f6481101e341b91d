"""Project tools outside the package, each run as `python -m tools.NAME` from the root (the Makefile names them)."""
