"""Device hygiene without a GPU: every tensor specdemo makes names the device it is made on, and draws from a generator
are made on the generator's own device. A CPU tensor meeting a CUDA generator (`torch.rand(..., generator=g)` with no
device) crashes on a GPU only; this rule over the source finds it on any machine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specdemo"
FACTORIES = frozenset(
    {"arange", "as_tensor", "empty", "eye", "full", "linspace", "ones", "rand", "randint", "randn", "randperm"}
    | {"tensor", "zeros", "Generator"}
)  # what makes a tensor (or a generator) from nothing; *_like, new_* and x.to(...) follow a tensor's device


def violations(source: str, name: str = "<source>") -> list[str]:
    """Every torch factory call that names no device, and every draw whose device is not its generator's."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        if node.func.attr not in FACTORIES:
            continue
        keywords = {keyword.arg: keyword.value for keyword in node.keywords}
        where = f"{name}:{node.lineno}: torch.{node.func.attr}"
        if "device" not in keywords:
            found.append(f"{where} names no device")
        elif "generator" in keywords:
            device = keywords["device"]
            own = isinstance(device, ast.Attribute) and device.attr == "device"
            if not (own and ast.dump(device.value) == ast.dump(keywords["generator"])):
                found.append(f"{where} draws from a generator on another device than the generator's")
    return found


def test_every_tensor_specdemo_makes_names_its_device():
    found = [v for path in sorted(PACKAGE.rglob("*.py")) for v in violations(path.read_text(), str(path))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        # the GPU crash of issue 36, as drafters/model.py and drafters/recurrent.py had it
        "u = torch.rand(3, dtype=torch.float64, generator=request.generator)",
        "u = torch.rand(3, dtype=torch.float64, generator=request.generator, device=logits.device)",
        "ids = torch.tensor(token_ids)",
        "g = torch.Generator().manual_seed(0)",
    ],
)
def test_the_rule_finds_a_tensor_made_on_the_wrong_device(line):
    assert violations(line)


@pytest.mark.parametrize(
    "line",
    [
        "u = torch.rand(3, dtype=torch.float64, generator=request.generator, device=request.generator.device)",
        "ids = torch.tensor(token_ids, device=logits.device)",
        "zeros = torch.zeros_like(logits)",
    ],
)
def test_the_rule_passes_a_tensor_made_where_it_is_used(line):
    assert not violations(line)


DEVICE_SYNCS = frozenset({"torch.cuda.synchronize", "torch.synchronize", "graphs.synchronize", "synchronize"})


def device_syncs(source: str, name: str = "<source>") -> list[str]:
    """Every wait for the whole device (torch.cuda.synchronize, or graphs' `synchronize`, kept for benchmarks' timers),
    not an event's: one in a round, in another thread, would break a capture under way (models/graphs.py)."""
    return [
        f"{name}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in DEVICE_SYNCS
    ]


def test_specdemo_waits_on_events_never_on_the_whole_device():
    """Rounds and loads wait on an event on their own stream (graphs.wait); only graphs.synchronize itself, which the
    benchmarks' timers call, waits for the whole device (and MPS, which has no events to wait on)."""
    allowed = {"specdemo/models/graphs.py"}
    found = [
        v
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE.parent)) not in allowed
        for v in device_syncs(path.read_text(), str(path))
    ]
    assert not found, "\n".join(found)
    assert device_syncs("torch.cuda.synchronize(device)") and device_syncs("graphs.synchronize(self.device)")
    assert not device_syncs("done.synchronize()")  # an event's
