"""Self-distillation data: the target answers the package's instructions itself (Hugging Face generate, batched), then
one teacher-forced pass records, per position, its final hidden state, its argmax and its top entries. Written in
chunks on disk, each under its final name only when complete, so an interrupted run resumes where it stopped."""

# T = a text's length (prompt and answer), H = hidden_size, A = TOP_ENTRIES

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdemo.config import check_int, check_number
from specdemo.models.loading import LoadedModel, chat_prompt_ids
from specdemo.training.instructions import SUBJECTS, TASKS, instructions

TOP_ENTRIES = 8  # the target's most probable tokens kept per position, for soft labels
BYTES_PER_TOKEN_PER_HIDDEN = 2  # hidden states are kept in bfloat16


@dataclass(frozen=True)
class DataSettings:
    """How many texts the target writes, and how."""

    num_texts: int = 1024
    max_new_tokens: int = 256
    temperature: float = 0.8  # sampled texts vary more than greedy ones; the labels are the argmax all the same
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("texts", self.num_texts, 16, len(TASKS) * len(SUBJECTS))
        check_int("new-tokens", self.max_new_tokens, 16, 1024)
        check_number("text-temperature", self.temperature, 0.0, 2.0)
        check_int("generate-batch-size", self.batch_size, 1, 64)


def chunk_paths(cache: Path, settings: DataSettings) -> list[Path]:
    count = -(-settings.num_texts // settings.batch_size)
    return [cache / f"texts-{index:04d}.pt" for index in range(count)]


def check_disk(cache: Path, settings: DataSettings, hidden_size: int) -> None:
    """One sentence before anything is written when the cache's disk cannot hold the texts' hidden states."""
    per_token = hidden_size * BYTES_PER_TOKEN_PER_HIDDEN + TOP_ENTRIES * 6 + 16
    needed = settings.num_texts * (settings.max_new_tokens + 64) * per_token
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < needed:
        raise ValueError(
            f"The training cache {cache} needs about {needed / 1e9:.2f} GB and its disk has {free / 1e9:.2f} GB free: "
            "free some space, or pass --cache on another disk, or fewer --texts."
        )


def write_texts(target: LoadedModel, settings: DataSettings, cache: Path) -> list[Path]:
    """Every chunk of texts with their features, written now or found from an earlier run."""
    check_disk(cache, settings, target.model.config.hidden_size)
    texts = instructions(settings.num_texts, settings.seed)
    paths = chunk_paths(cache, settings)
    missing = [index for index, path in enumerate(paths) if not path.exists()]
    for index in tqdm(missing, desc="target writes its texts", unit="chunk", disable=not missing):
        batch = texts[index * settings.batch_size : (index + 1) * settings.batch_size]
        record = _chunk(target, batch, settings, seed=settings.seed * 100_003 + index)
        partial = paths[index].with_suffix(".partial")
        torch.save(record, partial)
        partial.replace(paths[index])
    return paths


@torch.inference_mode()
def _chunk(target: LoadedModel, batch: list[str], settings: DataSettings, seed: int) -> dict[str, list]:
    prompts = [chat_prompt_ids(target, text)[0] for text in batch]
    sequences = _generate(target, prompts, settings, seed)
    return dict(
        prompt_lengths=[len(p) for p in prompts],
        token_ids=[s.to(torch.int32).cpu() for s in sequences],
        **_features(target, sequences),
    )


def _generate(target: LoadedModel, prompts: list[torch.Tensor], settings: DataSettings, seed: int) -> list:
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


def _features(target: LoadedModel, sequences: list[torch.Tensor]) -> dict[str, list]:
    """Teacher forcing, one text a pass (a batch's [B, T, V] logits would take gigabytes): per position, the final
    hidden state the LM head reads, the argmax and the top entries."""
    features: dict[str, list] = {"hidden": [], "argmax": [], "top_probs": [], "top_ids": []}
    for sequence in sequences:
        output = target.model(input_ids=sequence[None], output_hidden_states=True)
        hidden, logits = output.hidden_states[-1][0], output.logits[0].float()  # [T, H], [T, V]
        top = logits.softmax(dim=-1).topk(TOP_ENTRIES, dim=-1)  # [T, A]
        features["hidden"].append(hidden.to(torch.bfloat16).cpu())
        features["argmax"].append(logits.argmax(dim=-1).to(torch.int32).cpu())
        features["top_probs"].append(top.values.to(torch.float16).cpu())
        features["top_ids"].append(top.indices.to(torch.int32).cpu())
    return features
