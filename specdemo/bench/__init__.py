"""Benchmarks against Hugging Face generate: one prompt at a time, batched, and the app's streaming."""
