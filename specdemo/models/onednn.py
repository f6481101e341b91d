"""Which of oneDNN's CPU kernels torch may use for bfloat16 (ONEDNN_MAX_CPU_ISA, read when oneDNN first runs in a
process: `uncap` acts only before the first bfloat16 product).

Its AMX kernels (Intel Sapphire Rapids and later) give a row other logits beside other rows, which the bit-for-bit
batch tests catch on such a CPU. Serving promises those bits, so `import specdemo` caps oneDNN at AVX-512 BF16
(specdemo/__init__.py). Training promises none and writes its texts faster with AMX (`uncap`; docs/serving.md). A
value the user set is theirs, and stays."""

from __future__ import annotations

import os

VARIABLE = "ONEDNN_MAX_CPU_ISA"
BATCH_INVARIANT = "AVX512_CORE_BF16"  # the fastest kernels that kept a row's bits whatever its pass held
USERS_CHOICE = os.environ.get(VARIABLE)  # as the process started, before `import specdemo` capped it


def uncap() -> None:
    """oneDNN's fastest kernels, AMX included, unless the user chose: for work that promises no bit-for-bit rows."""
    if USERS_CHOICE is None:
        os.environ[VARIABLE] = "ALL"
