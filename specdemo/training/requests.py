"""Requests the target writes itself (Magpie: Xu et al. 2024, "Alignment Data Synthesis from Scratch by Prompting
Aligned LLMs with Nothing"). Given its chat template up to a user's message and nothing more, an instruction-tuned
model writes a user's message: one drawn from the kinds of request it was tuned on. The package's instructions are 100
kinds of request from templates, and the head drafts far better on answers to those kinds than on prompts unlike them
(docs/recurrent-drafter.md); the target's own requests come in as many kinds as it has seen. Written in seeded batches
and kept in one file, so a run resumes, and a shorter list is the start of a longer one."""

# B = requests written together, P = the user-turn prefix's length, N = new tokens of a batch

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdemo.models.loading import LoadedModel

REQUESTS_FORMAT = "specdemo-requests/1"
REQUEST_TOKENS = 96  # a request that has not ended within this many tokens is dropped
REQUEST_TEMPERATURE = 1.0  # Magpie's
REQUEST_TOP_P = 0.95  # trims the tail, where a small model's requests turn to noise
MIN_WORDS = 3  # "Hi!" is a request, but answers to greetings teach the head little
MARKER = "SPECDEMO-REQUEST-MARKER"


def user_turn_prefix(target: LoadedModel) -> str:
    """The chat template's text before a user's message: what the target reads when it writes one. One sentence if
    the target has no chat template."""
    template = target.tokenizer.chat_template
    if not template:
        raise ValueError(
            f"{target.name} has no chat template, so it cannot write requests of its own: train on the package's "
            "instructions (--instructions package)."
        )
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    return text[: text.index(MARKER)]


def request_settings(batch_size: int, seed: int) -> str:
    """What a list of requests depends on besides the target (the cache's folder names its weights)."""
    return (
        f"{REQUESTS_FORMAT}, T = {REQUEST_TEMPERATURE}, top-p {REQUEST_TOP_P}, at most {REQUEST_TOKENS} tokens, "
        f"at least {MIN_WORDS} words, B = {batch_size}, seed {seed}"
    )


def written_requests(target: LoadedModel, count: int, batch_size: int, seed: int, path: Path) -> list[str]:
    """`count` distinct requests written by the target: read from `path` where an earlier run wrote as many with
    these settings, else written on from where it stopped, each batch seeded by its index; saved after each batch.
    One sentence if the target writes too few usable ones."""
    settings = request_settings(batch_size, seed)
    record = _read(path)
    if record.get("settings") != settings:
        record = dict(settings=settings, batches=0, requests=[])
    requests: list[str] = record["requests"]
    seen = {_key(request) for request in requests}
    limit = record["batches"] + 4 * -(-(count - len(requests)) // batch_size) + 4  # a quarter usable at the least
    with tqdm(total=count, initial=min(count, len(requests)), desc="target writes requests", unit="request",
              disable=len(requests) >= count) as bar:  # fmt: skip
        while len(requests) < count:
            if record["batches"] >= limit:
                raise ValueError(
                    f"{target.name} wrote {len(requests)} usable requests in {record['batches']} batches, short of "
                    f"{count}: ask for fewer --texts, or train on the package's instructions (--instructions package)."
                )
            for request in write_batch(target, batch_size, seed=seed * 100_003 + record["batches"]):
                if _key(request) not in seen:
                    seen.add(_key(request))
                    requests.append(request)
                    bar.update(len(requests) <= count)
            record["batches"] += 1
            _write(record, path)
    return requests[:count]


def write_batch(target: LoadedModel, batch_size: int, seed: int) -> list[str]:
    """One batch of requests from the user-turn prefix, sampled; those that end within REQUEST_TOKENS, hold no other
    special token and have MIN_WORDS words, in order."""
    tokenizer = target.tokenizer
    prefix = tokenizer(user_turn_prefix(target), return_tensors="pt", add_special_tokens=False).input_ids  # [1, P]
    ids = prefix.to(target.device).expand(batch_size, -1)  # [B, P]
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    output = target.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=REQUEST_TOKENS,
        do_sample=True,
        temperature=REQUEST_TEMPERATURE,
        top_p=REQUEST_TOP_P,
        top_k=0,
        eos_token_id=sorted(target.eos_token_ids),
        pad_token_id=pad,
    )  # [B, P+N]
    special = set(tokenizer.all_special_ids) | set(target.eos_token_ids)
    kept = []
    for row in output[:, prefix.shape[1] :].tolist():
        ends = [i for i, token in enumerate(row) if token in target.eos_token_ids]
        if not ends or any(token in special for token in row[: ends[0]]):
            continue
        text = tokenizer.decode(row[: ends[0]]).strip()
        if len(text.split()) >= MIN_WORDS:
            kept.append(text)
    return kept


def _key(request: str) -> str:
    return " ".join(request.casefold().split())


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, or cut short
        return {}
    return record if isinstance(record, dict) and record.get("format") == REQUESTS_FORMAT else {}


def _write(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(dict(record, format=REQUESTS_FORMAT), ensure_ascii=False, indent=0))
    partial.replace(path)
