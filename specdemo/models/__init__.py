"""Models: loading (offline packages, the Hub), the cache that shares them, and the batched tree KV cache."""
