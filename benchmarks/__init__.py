"""The benchmarks the README and docs cite, each run as `python -m benchmarks.NAME` (benchmarks/README.md)."""
