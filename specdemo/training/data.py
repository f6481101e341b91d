"""Self-distillation data: the target answers the package's instructions itself (Hugging Face generate, batched), then
teacher-forced passes record, per position, the hidden states of the layers a head reads, the target's argmax and its
top entries. Texts and features are separate files, so a head that reads other layers reuses the texts; each layer's
states are a file of their own, so heads sharing a layer share it. Written in chunks on disk, each under its final name
only when complete, so an interrupted run resumes where it stopped; a chunk from another format, or features of other
texts, are written again, never misread."""

# T = a text's length (prompt and answer), H = hidden_size, A = TOP_ENTRIES

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdemo.config import check_int, check_number
from specdemo.models.loading import LoadedModel, chat_prompt_ids
from specdemo.training.instructions import SUBJECTS, TASKS, instructions, pool_digest

TOP_ENTRIES = 8  # the target's most probable tokens kept per position, for soft labels
BYTES_PER_TOKEN_PER_HIDDEN = 2  # hidden states are kept in bfloat16
TEXTS_FORMAT = "specdemo-texts/2"  # token ids alone (/1 chunks held the final states too)
FEATURES_FORMAT = "specdemo-features/2"
FEATURE_BATCH = 16  # texts a teacher-forced pass reads


@dataclass(frozen=True)
class DataSettings:
    """How many texts the target writes, and how."""

    num_texts: int = 1920  # of the 5,760 instructions: held-out α rose with the texts; 42.5 minutes here (docs/)
    max_new_tokens: int = 256
    temperature: float = 0.8  # sampled texts vary more than greedy ones; the labels are the target's all the same
    batch_size: int = 32  # the fastest measured here (benchmarks/text_speed.py, docs/recurrent-drafter.md)
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("texts", self.num_texts, 16, len(TASKS) * len(SUBJECTS))
        check_int("new-tokens", self.max_new_tokens, 16, 1024)
        check_number("text-temperature", self.temperature, 0.0, 2.0)
        check_int("generate-batch-size", self.batch_size, 1, 64)


def chunk_paths(cache: Path, settings: DataSettings) -> list[Path]:
    count = -(-settings.num_texts // settings.batch_size)
    return [cache / f"texts-{index:04d}.pt" for index in range(count)]


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


def write_texts(target: LoadedModel, settings: DataSettings, cache: Path, num_layers: int = 1) -> list[Path]:
    """Every chunk of texts (token ids), written now or found from an earlier run; first, one sentence if the disk
    cannot hold them with the features of `num_layers` layers."""
    check_disk(cache, settings, target.model.config.hidden_size, num_layers)
    texts = instructions(settings.num_texts, settings.seed)  # a run with fewer texts shares the first chunks
    paths = chunk_paths(cache, settings)
    missing = [index for index, path in enumerate(paths) if not texts_written(path, settings)]
    for index in tqdm(missing, desc="target writes its texts", unit="chunk", disable=not missing):
        batch = texts[index * settings.batch_size : (index + 1) * settings.batch_size]
        write_chunk(target, batch, settings, paths[index], seed=settings.seed * 100_003 + index)
    return paths


def texts_written(path: Path, settings: DataSettings) -> bool:
    """Whether `path` is a complete chunk of texts written with these settings from this pool."""
    return _valid(path, TEXTS_FORMAT, written_with(settings))


def write_chunk(target: LoadedModel, texts: list[str], settings: DataSettings, path: Path, seed: int) -> None:
    """The target's answers to `texts`, saved as one chunk under its final name once complete."""
    prompts = [chat_prompt_ids(target, text)[0] for text in texts]
    sequences = generate_texts(target, prompts, settings, seed=seed)
    record = dict(
        format=TEXTS_FORMAT,
        source=written_with(settings),
        prompt_lengths=[len(p) for p in prompts],
        token_ids=[s.to(torch.int32).cpu() for s in sequences],
    )
    _save(record, path)


def written_with(settings: DataSettings) -> str:
    """What a chunk's texts depend on besides their instructions: chunks written otherwise are written again."""
    return (
        f"{settings.max_new_tokens} tokens, T = {settings.temperature}, B = {settings.batch_size}, {settings.seed}, "
        f"instructions {pool_digest()}"
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
    """Each text chunk's labels and the states of `layers` (indices into hidden_states), written where missing."""
    todo = []
    for path in text_paths:
        texts = torch.load(path, weights_only=True)
        source = source_of(texts["token_ids"])
        missing = [
            name for name, file in features_paths(path, layers).items() if not _valid(file, FEATURES_FORMAT, source)
        ]
        if missing:
            todo.append((path, texts, source, missing))
    for path, texts, source, missing in tqdm(todo, desc="target reads its texts", unit="chunk", disable=not todo):
        wanted = tuple(int(name.removeprefix("layer ")) for name in missing if name != "labels")
        features = _features(target, [t.long().to(target.device) for t in texts["token_ids"]], wanted)
        files = features_paths(path, layers)
        for name in missing:
            part = {"labels": features["labels"]} if name == "labels" else {"hidden": features[name]}
            _save(dict(format=FEATURES_FORMAT, source=source, **part), files[name])


def generate_texts(target: LoadedModel, prompts: list[torch.Tensor], settings: DataSettings, seed: int) -> list:
    """Each prompt and its answer, up to and including the first EOS."""
    tokenizer, model = target.tokenizer, target.model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=target.device)  # [B, T] left padded
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :], mask[b, width - len(prompt) :] = prompt, 1
    torch.manual_seed(seed)
    sampled = settings.temperature > 0
    output = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=settings.max_new_tokens,
        do_sample=sampled,
        temperature=settings.temperature if sampled else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
    )
    sequences = []
    for b, prompt in enumerate(prompts):
        answer = output[b, width:].tolist()
        ends = [i for i, token in enumerate(answer) if token in target.eos_token_ids]
        answer = answer[: ends[0] + 1] if ends else answer
        sequences.append(torch.cat([prompt, torch.tensor(answer, device=prompt.device)]))
    return sequences


@torch.inference_mode()
def _features(target: LoadedModel, sequences: list[torch.Tensor], layers: tuple[int, ...]) -> dict[str, object]:
    """Teacher forcing, FEATURE_BATCH texts a pass (right-padded; the logits, [T, V] a text, are taken one text at a
    time from the final states): per position, the states of `layers`, the argmax and the top entries."""
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
                hidden[layer].append(states[layer][b, : len(sequence)].to(torch.bfloat16).cpu())
            logits = output_rows(states[-1][b, : len(sequence)]).float()  # [T, V]
            if cap:
                logits = torch.tanh(logits / cap) * cap
            top = logits.softmax(dim=-1).topk(TOP_ENTRIES, dim=-1)  # [T, A]
            labels["argmax"].append(logits.argmax(dim=-1).to(torch.int32).cpu())
            labels["top_probs"].append(top.values.to(torch.float16).cpu())
            labels["top_ids"].append(top.indices.to(torch.int32).cpu())
    return {"labels": labels} | {f"layer {layer}": hidden[layer] for layer in layers}
