"""Model names, device choice and the converted-weights cache."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from specdemo.models import loading as models
from specdemo.models.loading import (
    OFFLINE_DEFAULT,
    device_memory,
    dtype_reason,
    load_config,
    load_model,
    native_bfloat16,
    pick_device,
    resolve_dtype,
    resolve_source,
    weight_bytes,
)
from specdemo.models.offline import OFFLINE_MODELS, offline_source, one_gguf_reader
from specdemo.models.shared import ModelCache
from tests.helpers import save_tiny_model, tiny_model, word_tokenizer

CPU = torch.device("cpu")


def test_unknown_names_are_refused_with_the_way_forward():
    with pytest.raises(ValueError, match=r"'gpt-17' is not a valid model id: use one of 'smollm2-135m-instruct'"):
        resolve_source("gpt-17", print)


def test_unreachable_hub_id_says_so_without_waiting_on_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after import: must still be honoured

    def no_network(*args, **kwargs):
        raise AssertionError("a network connection was tried with HF_HUB_OFFLINE=1")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)  # every connection to a host name starts here
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(ValueError, match=r"Could not load 'nobody/no-such-model'.*offline, use"):
        load_model("nobody/no-such-model")


def test_specdemo_device_forces_the_device(monkeypatch):
    monkeypatch.setenv("SPECDEMO_DEVICE", "meta")
    assert pick_device() == torch.device("meta")
    monkeypatch.delenv("SPECDEMO_DEVICE")
    assert pick_device().type in {"cpu", "cuda", "mps"}


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU's flags as Linux lists them")
def test_native_bfloat16_agrees_with_the_cpus_flags():
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = {flag for line in lines if line.startswith("flags") for flag in line.partition(":")[2].split()}
    assert native_bfloat16(CPU) == bool(flags & {"amx_bf16", "avx512_bf16"})


def test_auto_picks_bfloat16_only_where_the_device_computes_in_it(monkeypatch):
    monkeypatch.setattr(models, "native_bfloat16", lambda device: False)  # this project's AVX2-only CPU
    assert resolve_dtype("auto", CPU) == torch.float32 and resolve_dtype("float32", CPU) == torch.float32
    assert dtype_reason("auto", CPU) == "float32 (auto: this CPU has no native bfloat16)"
    assert dtype_reason("float32", CPU) == "float32 (chosen)"
    with pytest.raises(
        ValueError, match=r"^This CPU has no native bfloat16 \(AMX or AVX-512 BF16\), so bfloat16 would"
    ):
        resolve_dtype("bfloat16", CPU)
    monkeypatch.setattr(models, "native_bfloat16", lambda device: True)  # AMX or AVX-512 BF16, or a CUDA GPU
    assert resolve_dtype("auto", CPU) == torch.bfloat16 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert dtype_reason("auto", CPU) == "bfloat16 (auto: this CPU has native bfloat16)"
    assert dtype_reason("auto", torch.device("cuda")) == "bfloat16 (auto: CUDA)"
    for name in ["float64", "Auto", ""]:
        with pytest.raises(
            ValueError, match=r"^Unknown number format .*: use auto .*, float32, bfloat16 or float16\.$"
        ):
            resolve_dtype(name, CPU)


def test_the_cache_loads_a_model_again_when_asked_for_another_format():
    class Loaded:  # stands in for a LoadedModel: its device and dtype
        def __init__(self, name: str, progress, device, dtype) -> None:
            self.device, self.model = device, type("Model", (), {"dtype": dtype})()

    cache = ModelCache(Loaded)
    first = cache.get("a/model", device=CPU, dtype=torch.float32)
    assert cache.get("a/model", device=CPU, dtype=torch.float32) is first
    assert cache.get("a/model") is first  # no format asked for: the one held
    second = cache.get("a/model", device=CPU, dtype=torch.bfloat16)
    assert second is not first and second.model.dtype == torch.bfloat16
    assert list(cache.models) == ["a/model"]  # one copy held: the new format replaced the old


def test_a_conversion_parses_each_gguf_once_and_leaves_the_reader_as_it_was(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("w", np.ones((2, 2), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    original = gguf.GGUFReader
    with one_gguf_reader():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the tokenizer, config and weights loads share one parse
        tokens = first.fields["tokenizer.ggml.tokens"]
        assert [bytes(tokens.parts[i]) for i in tokens.data] == [b"a", b"b", b"c"]
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(path) is not first


def test_offline_default_loads_from_the_converted_cache_without_reading_the_gguf(offline_model, monkeypatch):
    import gguf

    directory = Path(offline_source(OFFLINE_MODELS[OFFLINE_DEFAULT], print))  # converted already by the fixture
    assert (directory / "model.safetensors").is_file()

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was read again: the safetensors cache is not being used")

    monkeypatch.setattr(gguf, "GGUFReader", no_gguf)
    again = load_model(OFFLINE_DEFAULT, device=torch.device("cpu"))
    assert again.model.config.vocab_size == 49152


def test_weight_bytes_counts_a_tied_embedding_once():
    """Counted on the meta device, a model whose output layer is its input embedding counts that matrix once, as the
    loaded model holds it (accelerate's init_empty_weights untied it: SmolLM2-135M came to 162.8M, not 134.5M)."""
    for tied in (True, False):
        model = tiny_model(0)
        model.config.tie_word_embeddings = tied
        built = type(model)(model.config)  # ties, or not, as from_pretrained would
        held = sum(parameter.numel() for parameter in built.parameters())
        assert weight_bytes(built.config, torch.float16) == 2 * held, f"tied={tied}"
        assert (built.lm_head.weight is built.model.embed_tokens.weight) == tied


def test_on_zerogpu_cuda_memory_is_the_lent_gpus_and_loading_skips_the_warm_up(tmp_path, monkeypatch):
    """The Space's own process has no GPU: the memory is the whole GPU a call is lent (free and total), not what
    torch reads; and a load runs no warm-up passes there (they would run on the CPU through spaces' emulation)."""
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setattr(models, "zerogpu_memory_bytes", lambda: 48 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("torch's CUDA memory was read"))
    assert device_memory(torch.device("cuda")) == (48 * 2**30, 48 * 2**30)
    assert device_memory(CPU)[1] > 0  # the CPU's as ever
    directory = save_tiny_model(tmp_path / "model", word_tokenizer(["<unk>", "</s>", "a"]), seed=0)
    warmed = []
    monkeypatch.setattr(models, "warm_up", warmed.append)
    load_model(str(directory), device=CPU)
    assert warmed == []
    monkeypatch.setenv("SPACES_ZERO_GPU", "false")
    loaded = load_model(str(directory), device=CPU)
    assert warmed == [loaded.model]


def test_a_gated_repository_is_one_sentence_naming_hf_token(monkeypatch):
    """huggingface_hub's GatedRepoError, as transformers wraps it in an OSError of its own: not "does not exist"."""
    from huggingface_hub.errors import GatedRepoError

    def refuse(*args, **kwargs):
        gated = GatedRepoError.__new__(GatedRepoError)  # its constructor wants an HTTP response
        Exception.__init__(gated, "401 Client Error. Cannot access gated repo for url ...")
        raise OSError("You are trying to access a gated repo.") from gated

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no probe of the Hub
    monkeypatch.setattr(models.AutoConfig, "from_pretrained", refuse)
    with pytest.raises(ValueError) as refused:
        load_config("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct")
    assert str(refused.value) == (
        "'meta-llama/Llama-3.1-8B-Instruct' is gated on the Hub: accept its licence on its model page and set "
        "HF_TOKEN (a Space secret) to a token of that account, or pick another pair."
    )

    def missing(*args, **kwargs):
        raise OSError("nobody/no-such-model is not a local folder and is not a valid model identifier")

    monkeypatch.setattr(models.AutoConfig, "from_pretrained", missing)
    with pytest.raises(ValueError, match=r"^Could not load 'nobody/no-such-model': it does not exist"):
        load_config("nobody/no-such-model", "nobody/no-such-model")


def test_load_model_takes_a_formats_name_and_refuses_an_unknown_one_in_a_sentence(tmp_path):
    """The public load_model names its formats as the CLI does ("float32", "auto"), and an unknown name is the sentence
    resolve_dtype gives, before anything loads. Planted: the name passed on to transformers as it is."""
    directory = save_tiny_model(tmp_path / "model", word_tokenizer(["<unk>", "</s>", "a"]), seed=0)
    assert load_model(str(directory), device=CPU, dtype="float32").model.dtype == torch.float32
    with pytest.raises(ValueError, match=r"^Unknown number format 'float8': use auto "):
        load_model(str(directory), device=CPU, dtype="float8")
