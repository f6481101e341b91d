"""Fixtures: tiny random models, the real offline SmolLM2 and the app launched on it; and the markers of the test
tiers (slow: a real model or the app; browser: Chromium), set from the fixtures a test uses."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM

from specdemo.engine.resources import release_openmp_workers
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel, load_model, native_bfloat16
from specdemo.models.packed import FLOAT32_VARIABLE, pack
from tests.helpers import tiny_model, train_tiny_head

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # tests never phone home
# float32 models keep the stock linears, Hugging Face's, on every machine, whatever packing would pay here (the parity
# tests compare with generate); a test that wants packed float32 linears asks (offline_packed_float32, test_packed.py)
os.environ.setdefault(FLOAT32_VARIABLE, "0")
if "PYTEST_XDIST_WORKER" in os.environ:  # each worker's apps keep their files apart: a worker's count of its
    # downloads folder must not meet another's runs (test_many_runs_leave_a_bounded_folder_of_downloads did, once)
    os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix=f"gradio-{os.environ['PYTEST_XDIST_WORKER']}-"))
    # and its share of the cores: two workers of two threads each on 2 cores took 24% longer than of one each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

SLOW_FIXTURES = {"offline_model", "offline_bfloat16", "offline_packed_float32", "invariant_model"}
SLOW_FIXTURES |= {"app", "app_server", "client", "gemma", "browser"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs a real model or the app is `slow`; one that needs Chromium is `browser` too."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if "browser" in used:
            item.add_marker(pytest.mark.browser)


@pytest.fixture(autouse=True)
def main_thread_without_openmp_workers() -> None:
    """Each test begins as app.py serves: the thread that loaded the models keeps no OpenMP workers while the app's
    threads decode (resources.release_openmp_workers; a test's own torch work starts them anew)."""
    release_openmp_workers()


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    return tiny_model(seed=1)


@pytest.fixture(scope="session")
def tiny_draft() -> LlamaForCausalLM:
    return tiny_model(seed=2, num_layers=1)


@pytest.fixture(scope="session")
def tiny_trained_head(tiny_target, tmp_path_factory):
    """A recurrent head trained on tiny_target's own greedy texts (seconds): its drafts are often accepted."""
    return train_tiny_head(tiny_target, tmp_path_factory.mktemp("head"))[0]


@pytest.fixture(scope="session")
def offline_model() -> LoadedModel:
    return load_model(OFFLINE_DEFAULT, device=torch.device("cpu"), dtype=torch.float32)  # parity tests need float32


@pytest.fixture(scope="session")
def offline_bfloat16() -> LoadedModel:
    """The offline default in bfloat16, the number format the app serves on a CPU that has it natively."""
    if not native_bfloat16(torch.device("cpu")):
        pytest.skip("this CPU has no native bfloat16")
    return load_model(OFFLINE_DEFAULT, device=torch.device("cpu"), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def offline_packed_float32() -> LoadedModel:
    """The offline default in float32 with its linears packed (models/packed.py), as it runs where that pays."""
    loaded = load_model(OFFLINE_DEFAULT, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FLOAT32_VARIABLE, "1")
        if not pack(loaded.model):
            pytest.skip("oneDNN cannot pack float32 linears here, keeping each row's bits")
    return loaded


@pytest.fixture(params=["bfloat16", "packed float32"])
def invariant_model(request: pytest.FixtureRequest) -> LoadedModel:
    """The offline default in each format whose passes keep a row's bits in any batch."""
    return request.getfixturevalue("offline_bfloat16" if request.param == "bfloat16" else "offline_packed_float32")


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven through playwright (each test opens its own page), launched once per module (about a
    second): not per session, since playwright's sync API keeps an event loop running in the thread while it is open,
    and a later test's `asyncio.run` there refuses to start (tests/app/test_serving.py)."""
    from playwright.sync_api import sync_playwright

    from tests.app_helpers import CHROMIUM, CHROMIUM_FLAGS

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def app_and_server(offline_model) -> Iterator[tuple[str, object]]:
    """The app launched in-process on the offline default (already loaded): its URL and its server state."""
    from tests.app_helpers import launched_app  # Gradio, imported only where the app is tested

    with launched_app(offline_model) as (url, server):
        yield url, server


@pytest.fixture(scope="session")
def app(app_and_server) -> str:
    return app_and_server[0]


@pytest.fixture
def app_server(app_and_server):
    return app_and_server[1]
