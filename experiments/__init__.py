"""Experiments whose results are recorded (experiments/README.md): run as `python -m experiments.NAME`, imported by
nothing in specdemo/ or tests/."""
