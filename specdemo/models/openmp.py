"""How long OpenMP's idle workers spin before they sleep (GOMP_SPINCOUNT, read once, when torch loads libgomp:
`import specdemo` sets it first, specdemo/__init__.py).

libgomp's default spins up to 300,000 times. Beside another process that keeps the cores busy, each worker then waits on
one the system has descheduled: the CLI's target-only decoding on 2 cores kept 0.14 (Intel Xeon) and 0.34 (AMD EPYC) of
its idle speed at the default, and 0.68 and 0.54 at 2,000, which costs an eighth to a fifth of the idle speed; on the
Xeon no count between kept both (`python -m benchmarks.busy --spin-counts ...`; docs/serving.md, "A busy machine"). The
app, the CLI and the tests take 2,000; a value the user set is theirs, and stays, and a process that loaded torch before
specdemo keeps what torch read."""

from __future__ import annotations

VARIABLE = "GOMP_SPINCOUNT"
SPIN_COUNT = "2000"
