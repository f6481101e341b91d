"""How long OpenMP's idle workers spin before they sleep (GOMP_SPINCOUNT, read once, when torch loads libgomp:
`import specdemo` sets it first, specdemo/__init__.py).

Spinning is what keeps a pass fast: between two parallel regions a worker that slept must be woken, and a one-token
step of SmolLM2 runs over a hundred regions. On the AMD EPYC of docs/serving.md, 2 cores, the CLI's target-only
decoding ran at 27 tokens/s at 2,000 spins and at 32 from 10,000 to libgomp's 300,000, while Hugging Face `generate`
kept its speed. Beside a process that keeps the cores busy, spinning workers wait on descheduled ones (3 tokens/s at
30,000 spins on two threads): models/threads.py then runs the passes on fewer threads. The app and the CLI take
30,000 (on an Intel Xeon, 27.3 tokens/s idle at 10,000 against 29.1 at 30,000); a value the user set is theirs, and
stays, and a process that loaded torch before specdemo keeps what torch read. `make test` sets 2,000: its two workers
share the 2 cores."""

from __future__ import annotations

VARIABLE = "GOMP_SPINCOUNT"
SPIN_COUNT = "30000"
