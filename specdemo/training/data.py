"""Self-distillation data: the target answers the package's instructions itself (Hugging Face generate, batched), and
records as it writes, per position, the hidden states of the layers a head reads, its argmax and its top entries (its
features). Texts and features are separate files: a head that reads other layers reuses the texts, and a teacher-forced
pass over them records the missing features. Each layer's states are a file of their own, so heads sharing a layer
share it. Written in chunks on disk, each under its final name only when complete, so an interrupted run resumes where
it stopped; a chunk from another format, or features of other texts, are written again, never misread."""

# T = a text's length (prompt and answer), P = its prompt's, H = hidden_size, A = TOP_ENTRIES, V = vocabulary,
# B = texts generated together, W = the longest prompt of B (they are left padded to it)

from __future__ import annotations

import hashlib
import math
import shutil
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from specdemo.config import check_int, check_number
from specdemo.models.loading import LoadedModel, chat_prompt_ids
from specdemo.training.instructions import SUBJECTS, TASKS, instructions, pool_digest
from specdemo.training.requests import request_settings, written_requests

TOP_ENTRIES = 8  # the target's most probable tokens kept per position, for soft labels
BYTES_PER_TOKEN_PER_HIDDEN = 2  # hidden states are kept in bfloat16
TEXTS_FORMAT = "specdemo-texts/2"  # token ids alone (/1 chunks held the final states too)
FEATURES_FORMAT = "specdemo-features/3"  # states at 0..T-2, labels at P..T-1 (/2 held T of each, prompts' labels too)
FEATURE_BATCH = 16  # texts a teacher-forced pass reads
IGNORE = -100  # no label: the target's prediction after a text's EOS (nothing is drafted there)
INSTRUCTIONS = ("package", "target", "both")  # the package's instructions, requests the target writes, half of each
TARGET_REQUESTS = "target-requests"  # the cache's folder for the texts answering the target's own requests
MAX_TEXTS = 200_000  # of the target's own requests


@dataclass(frozen=True)
class DataSettings:
    """How many texts the target writes, and how."""

    num_texts: int = 3840  # of the 9,600 instructions: held-out α rose with the texts; about 31 minutes here (docs/)
    max_new_tokens: int = 128  # what the app and the benchmarks write: 256 wrote half the texts in the same time
    temperature: float = 0.8  # sampled texts vary more than greedy ones; the labels are the target's all the same
    batch_size: int = 32  # the fastest measured here (benchmarks/text_speed.py, docs/recurrent-drafter.md)
    seed: int = 0
    instructions: str = "package"  # what the target answers: INSTRUCTIONS

    def __post_init__(self) -> None:
        if self.instructions not in INSTRUCTIONS:
            raise ValueError(f"instructions must be one of {', '.join(INSTRUCTIONS)}, got {self.instructions!r}.")
        pool = len(TASKS) * len(SUBJECTS)  # the package's instructions: "both" takes half its texts from them
        check_int("texts", self.num_texts, 16, dict(package=pool, target=MAX_TEXTS, both=2 * pool)[self.instructions])
        check_int("new-tokens", self.max_new_tokens, 16, 1024)
        check_number("text-temperature", self.temperature, 0.0, 2.0)
        check_int("generate-batch-size", self.batch_size, 1, 1024)


def chunk_paths(cache: Path, settings: DataSettings) -> list[Path]:
    count = -(-settings.num_texts // settings.batch_size)
    folder = cache / TARGET_REQUESTS if settings.instructions == "target" else cache
    return [folder / f"texts-{index:04d}.pt" for index in range(count)]


def halves(settings: DataSettings) -> tuple[DataSettings, DataSettings]:
    """For "both": the package's instructions for half the texts, the target's own requests for the rest."""
    package = settings.num_texts - settings.num_texts // 2
    return (replace(settings, instructions="package", num_texts=package),
            replace(settings, instructions="target", num_texts=settings.num_texts - package))  # fmt: skip


def check_disk(cache: Path, settings: DataSettings, hidden_size: int, num_layers: int = 1) -> None:
    """One sentence before anything is written when the cache's disk cannot hold the texts' hidden states."""
    per_token = num_layers * hidden_size * BYTES_PER_TOKEN_PER_HIDDEN + TOP_ENTRIES * 6 + 16
    needed = settings.num_texts * (settings.max_new_tokens + 64) * per_token
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < needed:
        raise ValueError(
            f"The training cache {cache} needs about {needed / 1e9:.2f} GB and its disk has {free / 1e9:.2f} GB free: "
            "free some space, or pass --cache on another disk, or fewer --texts."
        )


def _valid(path: Path, format_: str, source: str) -> bool:
    """Whether `path` is a complete chunk of this format (and of these texts): anything else is written again."""
    try:
        record = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError):  # missing, or not a torch file
        return False
    return isinstance(record, dict) and record.get("format") == format_ and record.get("source") == source


def _save(record: dict, path: Path) -> None:
    partial = path.with_suffix(".partial")
    torch.save(record, partial)
    partial.replace(path)


def write_texts(target: LoadedModel, settings: DataSettings, cache: Path, layers: tuple[int, ...] = ()) -> list[Path]:
    """Every chunk of texts (token ids), written now with their features for `layers` (indices into hidden_states) or
    found from an earlier run; first, one sentence if the disk cannot hold them. "both" interleaves the chunks of its
    two halves, so the last chunks, held out, answer both kinds of instruction."""
    if settings.instructions == "both":
        package, own = (write_texts(target, half, cache, layers) for half in halves(settings))
        return [path for pair in zip_longest(package, own) for path in pair if path is not None]
    check_disk(cache, settings, target.model.config.hidden_size, max(1, len(layers)))
    paths = chunk_paths(cache, settings)
    if settings.instructions == "target":  # the requests' file lies beside their texts
        requests = paths[0].with_name("requests.json")
        texts = written_requests(target, settings.num_texts, settings.batch_size, settings.seed, requests)
    else:
        texts = instructions(settings.num_texts, settings.seed)  # a run with fewer texts shares the first chunks
    missing = [index for index, path in enumerate(paths) if not texts_written(path, settings)]
    for index in tqdm(missing, desc="target writes its texts", unit="chunk", disable=not missing):
        batch = texts[index * settings.batch_size : (index + 1) * settings.batch_size]
        write_chunk(target, batch, settings, paths[index], seed=settings.seed * 100_003 + index, layers=layers)
    return paths


def texts_written(path: Path, settings: DataSettings) -> bool:
    """Whether `path` is a complete chunk of texts written with these settings from this pool."""
    return _valid(path, TEXTS_FORMAT, written_with(settings))


def write_chunk(
    target: LoadedModel, texts: list[str], settings: DataSettings, path: Path, seed: int, layers: tuple[int, ...] = ()
) -> None:
    """The target's answers to `texts`, saved as one chunk, with their features (labels and `layers`' states) as
    recorded while writing, each file under its final name once complete."""
    prompts = [chat_prompt_ids(target, text)[0] for text in texts]
    sequences, features = generate_texts(target, prompts, settings, seed=seed, layers=layers)
    token_ids = [s.to(torch.int32).cpu() for s in sequences]
    _save_features(features, features_paths(path, layers), source_of(token_ids))
    record = dict(format=TEXTS_FORMAT, source=written_with(settings), prompt_lengths=[len(p) for p in prompts],
                  token_ids=token_ids)  # fmt: skip
    _save(record, path)


def written_with(settings: DataSettings) -> str:
    """What a chunk's texts depend on besides their instructions: chunks written otherwise are written again."""
    if settings.instructions == "both":
        return "; ".join(map(written_with, halves(settings)))
    sampler = " by inverse CDF" if settings.temperature > 0 else ""  # texts sampled by torch.multinomial are older
    pool = (
        f"instructions {pool_digest()}"
        if settings.instructions == "package"
        else f"the target's requests ({request_settings(settings.batch_size, settings.seed)})"
    )
    return (
        f"{settings.max_new_tokens} tokens, T = {settings.temperature}{sampler}, B = {settings.batch_size}, "
        f"{settings.seed}, {pool}"
    )


def features_paths(text_path: Path, layers: tuple[int, ...]) -> dict[str, Path]:
    """The files of a text chunk's features: its labels, and each layer's states (by hidden_states index)."""
    stem = text_path.stem.removeprefix("texts-")
    paths = {"labels": text_path.with_name(f"labels-{stem}.pt")}
    return paths | {f"layer {layer}": text_path.with_name(f"layer{layer:03d}-{stem}.pt") for layer in layers}


def source_of(token_ids: list[torch.Tensor]) -> str:
    """A hash of a chunk's texts: features record it, so features of other texts are never read as these."""
    digest = hashlib.blake2b(digest_size=8)
    for tokens in token_ids:
        digest.update(tokens.to(torch.int32).numpy().tobytes() + b"|")
    return digest.hexdigest()


def write_features(target: LoadedModel, text_paths: list[Path], layers: tuple[int, ...]) -> None:
    """Each text chunk's labels and the states of `layers` (indices into hidden_states), where missing (texts written
    for other layers, or by an earlier format), by teacher-forced passes over them."""
    todo = []
    for path in text_paths:
        texts = torch.load(path, weights_only=True)
        source = source_of(texts["token_ids"])
        files = features_paths(path, layers)
        missing = [name for name, file in files.items() if not _valid(file, FEATURES_FORMAT, source)]
        if missing:
            todo.append((texts, source, {name: files[name] for name in missing}))
    for texts, source, files in tqdm(todo, desc="target reads its texts", unit="chunk", disable=not todo):
        wanted = tuple(int(name.removeprefix("layer ")) for name in files if name != "labels")
        sequences = [t.long().to(target.device) for t in texts["token_ids"]]
        _save_features(_features(target, sequences, texts["prompt_lengths"], wanted), files, source)


def _save_features(features: dict[str, object], files: dict[str, Path], source: str) -> None:
    for name, file in files.items():
        part = {"labels": features["labels"]} if name == "labels" else {"hidden": features[name]}
        _save(dict(format=FEATURES_FORMAT, source=source, **part), file)


class _Labels(LogitsProcessor):
    """Keeps the target's argmax and top entries at every step of `generate`, from its scores as the model gave them
    (processors passed in run before the temperature), which it passes on unchanged."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(_top_entries(scores))
        return scores


class InverseCDFSampler(LogitsProcessor):
    """Samples each text's next token from softmax(scores / T) by the inverse of its cumulative distribution, one
    uniform number a text, and leaves it the only finite score, for generate's greedy step to take. do_sample's
    torch.multinomial draws an exponential number for every entry of the vocabulary: 41 ms a draw, this 12 (B = 32)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = (scores / self.temperature).softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)  # [B, V]
        uniform = torch.rand(len(scores), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [B, 1]
        token = torch.searchsorted(cdf, uniform, right=True).clamp(max=scores.shape[-1] - 1)  # cdf[i-1] <= u < cdf[i]
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)


def _top_entries(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., V] logits: the argmax, and the probabilities and ids of the A most probable tokens, as stored."""
    top = logits.float().softmax(dim=-1).topk(TOP_ENTRIES, dim=-1)
    return logits.argmax(dim=-1).to(torch.int32), top.values.to(torch.float16), top.indices.to(torch.int32)


def _append_labels(labels: dict[str, list], entries: tuple[torch.Tensor, ...], ended: bool) -> None:
    """One text's labels at P..T-1, from `entries` of its states at P..T-1, or at P..T-2 where it ends with an EOS:
    there is no label after an EOS."""
    argmax, probs, ids = (entry.cpu() for entry in entries)
    if ended:
        argmax = torch.cat([argmax, torch.tensor([IGNORE], dtype=argmax.dtype, device="cpu")])
        probs = torch.cat([probs, probs.new_zeros(1, TOP_ENTRIES)])
        ids = torch.cat([ids, ids.new_zeros(1, TOP_ENTRIES)])
    labels["argmax"].append(argmax)
    labels["top_probs"].append(probs)
    labels["top_ids"].append(ids)


def generate_texts(
    target: LoadedModel, prompts: list[torch.Tensor], settings: DataSettings, seed: int, layers: tuple[int, ...] = ()
) -> tuple[list[torch.Tensor], dict[str, object]]:
    """Each prompt and its answer, up to and including the first EOS, and its features as `generate` computed them:
    the states of `layers` at positions 0..T-2 and the labels at P..T-1 (see _features). One step more than the
    answers' length is run, so that a text cut at max_new_tokens has the target's prediction after its last token;
    the target reads a text's EOS only where another text goes on, and no label follows an EOS."""
    tokenizer, model = target.tokenizer, target.model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=target.device)  # [B, W] left padded
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :], mask[b, width - len(prompt) :] = prompt, 1
    torch.manual_seed(seed)
    recorder = _Labels()  # steps[s] is of the state at padded column W-1+s: the prediction of answer token s
    sampler = [InverseCDFSampler(settings.temperature)] if settings.temperature > 0 else []  # else greedy
    output = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=settings.max_new_tokens + 1,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
        logits_processor=LogitsProcessorList([recorder, *sampler]),
        output_hidden_states=bool(layers),
        return_dict_in_generate=True,
    )
    steps = [torch.stack(entry, dim=1) for entry in zip(*recorder.steps, strict=True)]  # each [B, S, ...]
    prefill = {layer: output.hidden_states[0][layer] for layer in layers}  # [B, W, H]; none without layers
    decoded = {  # [B, S-1, H]: the state of answer token s at column s
        layer: torch.cat([prefill[layer][:, :0], *(step[layer] for step in output.hidden_states[1:])], dim=1)
        for layer in layers
    }
    sequences, hidden = [], {layer: [] for layer in layers}
    labels: dict[str, list] = {"argmax": [], "top_probs": [], "top_ids": []}
    for b, prompt in enumerate(prompts):
        answer = output.sequences[b, width : width + settings.max_new_tokens].tolist()
        ends = [i for i, token in enumerate(answer) if token in target.eos_token_ids]
        answer = answer[: ends[0] + 1] if ends else answer
        sequences.append(torch.cat([prompt, torch.tensor(answer, device=prompt.device)]))
        for layer in layers:
            states = torch.cat([prefill[layer][b, width - len(prompt) :], decoded[layer][b, : len(answer) - 1]])
            hidden[layer].append(states.to(torch.bfloat16).cpu())
        labelled = len(answer) - bool(ends)  # answer tokens whose state has labels: every one before an EOS
        _append_labels(labels, tuple(step[b, 1 : labelled + 1] for step in steps), bool(ends))
    return sequences, {"labels": labels} | {f"layer {layer}": hidden[layer] for layer in layers}


@torch.inference_mode()
def _features(
    target: LoadedModel, sequences: list[torch.Tensor], prompt_lengths: list[int], layers: tuple[int, ...]
) -> dict[str, object]:
    """Teacher forcing, FEATURE_BATCH texts a pass (right-padded; the logits, [T, V] a text, are taken one text at a
    time from the final states): the states of `layers` at positions 0..T-2 (a head reads h_t and x_{t+1}), and at
    the answer's positions P..T-1 the target's argmax and top entries, none after an EOS."""
    model = target.model
    output_rows = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    labels: dict[str, list] = {"argmax": [], "top_probs": [], "top_ids": []}
    hidden: dict[int, list] = {layer: [] for layer in layers}
    for first in range(0, len(sequences), FEATURE_BATCH):
        batch = sequences[first : first + FEATURE_BATCH]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=target.device)  # [B, T]
        mask = torch.zeros_like(ids)
        for b, sequence in enumerate(batch):
            ids[b, : len(sequence)], mask[b, : len(sequence)] = sequence, 1
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states
        for b, sequence in enumerate(batch):
            for layer in layers:
                hidden[layer].append(states[layer][b, : len(sequence) - 1].to(torch.bfloat16).cpu())
            ended = int(sequence[-1]) in target.eos_token_ids
            labelled = states[-1][b, prompt_lengths[first + b] : len(sequence) - ended]  # [T-P(-1), H]
            logits = output_rows(labelled).float()
            if cap:
                logits = torch.tanh(logits / cap) * cap
            _append_labels(labels, _top_entries(logits), ended)
    return {"labels": labels} | {f"layer {layer}": hidden[layer] for layer in layers}
