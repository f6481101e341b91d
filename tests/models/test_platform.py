"""Where runs decode, as the page says it: on ZeroGPU the lent GPU's name and memory come from torch.cuda as `spaces`
patches it in the Space's process (run here with spaces 0.51.3's own patch and its table of cards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from specdemo.models.platform import device_line, zerogpu_memory_bytes

ROOT = Path(__file__).resolve().parents[2]
BLACKWELL, H200 = "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA H200"


def lent_as_zerogpu_says(model: str, sizes: tuple[str | None, ...]) -> list[dict]:
    """In a fresh process, as on a ZeroGPU machine whose NVIDIA driver names `model`: spaces reads its table's entry
    for the model and patches torch.cuda with it (its own patch()); then, for each call size spaces would pick, the
    page's device line and the memory loading counts on. Stubbed: only the driver's file and this CPU build's CUDA."""
    script = textwrap.dedent(f"""
        import json, os
        import torch
        torch.version.cuda = "12.8"  # spaces' stand-in picks its memory statistics by the CUDA build; this one has none
        torch._C._cuda_init = lambda: None  # spaces keeps the CUDA build's own, to put back in a call's worker
        import spaces.zero, spaces.zero.config  # SPACES_ZERO_GPU unset yet: nothing patched at import
        spaces.zero.config._read_gpu_information = lambda: "Model: \\t\\t {model}\\nIRQ: 42\\n"  # the driver's file
        from specdemo.models.loading import device_memory
        from specdemo.models.platform import device_line, zerogpu_memory_bytes
        import spaces.zero.torch as zero_torch  # reads spaces' table for the model above
        zero_torch.patch()  # as `import spaces` does on ZeroGPU
        os.environ["SPACES_ZERO_GPU"] = "true"
        seen = []
        for size in {sizes!r}:
            spaces.zero._default_gpu_size = size  # as spaces' startup sets it from the packed weights' size
            cuda = torch.device("cuda")
            seen.append({{"line": device_line(cuda, "bfloat16"), "bytes": zerogpu_memory_bytes(),
                         "device_memory": list(device_memory(cuda))}})
        print(json.dumps(seen))
    """)
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("SPACES_", "ZEROGPU_"))}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_on_zerogpu_the_device_line_names_the_card_spaces_patches_torch_with():
    """ZeroGPU's current card, an RTX PRO 6000 split in two: a default (`large`) call is lent half of it, a call that
    spaces makes `xlarge` (packed weights past its threshold) the whole of it. The H200 entry is already a slice."""
    half, whole = lent_as_zerogpu_says(BLACKWELL, (None, "xlarge"))
    assert half["line"].startswith(f"Runs on ZeroGPU: half an {BLACKWELL} (51.0 GB), lent for each run · bfloat16")
    assert half["bytes"] == 101_973_950_464 // 2 and half["device_memory"] == [half["bytes"]] * 2
    assert whole["line"].startswith(f"Runs on ZeroGPU: {BLACKWELL} (102.0 GB), lent for each run")
    assert whole["bytes"] == 101_973_950_464
    (h200,) = lent_as_zerogpu_says(H200, (None,))
    assert h200["line"].startswith(f"Runs on ZeroGPU: {H200} (74.6 GB), lent for each run")
    assert h200["bytes"] == 74_625_056_768 and h200["device_memory"] == [h200["bytes"]] * 2


def test_where_spaces_has_not_patched_torch_zerogpu_is_its_documented_default(monkeypatch):
    """No `spaces` import here (a command, this test): half the RTX PRO 6000, ZeroGPU's default size."""
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert zerogpu_memory_bytes() == 101_973_950_464 // 2
    assert device_line(torch.device("cpu"), "float32").startswith(f"Runs on ZeroGPU: half an {BLACKWELL} (51.0 GB)")
