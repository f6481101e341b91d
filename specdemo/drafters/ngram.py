"""Prompt lookup (Saxena 2023): copy what followed the latest earlier occurrences of the sequence's last n tokens."""

# T = sequence length, W = num_candidates, K = num_draft_tokens

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from specdemo.config import check_settings, setting
from specdemo.drafters.base import Draft, DraftRequest

MAX_NGRAM_SIZE = 8


@dataclass(frozen=True)
class NgramOptions:
    max_ngram_size: int = setting(
        3,
        "max-ngram-size",
        low=1,
        high=MAX_NGRAM_SIZE,
        whole=True,
        label="Longest n-gram matched",
        help="prompt lookup: the longest n-gram matched, tried first",
    )
    # one-token matches in free text are mostly noise, and on a CPU a rejected proposal costs a multi-token pass,
    # dearer than a one-token step (bench --min-ngram-size 1); with W > 1 the later candidates follow them anyway
    min_ngram_size: int = setting(
        2,
        "min-ngram-size",
        low=1,
        high=MAX_NGRAM_SIZE,
        whole=True,
        label="Shortest n-gram matched",
        help="prompt lookup: the shortest n-gram matched, with one candidate per round",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.min_ngram_size > self.max_ngram_size:
            raise ValueError(
                f"min-ngram-size must be at most max-ngram-size ({self.max_ngram_size}), got {self.min_ngram_size}."
            )


def find_ngram_continuations(
    sequence_ids: torch.Tensor,  # [T] int64
    num_draft_tokens: int,
    num_candidates: int,
    max_ngram_size: int,
    min_ngram_size: int = 1,
) -> list[list[int]]:  # up to num_candidates distinct continuations of at most num_draft_tokens tokens
    """Prompt lookup (Saxena 2023): find earlier occurrences of the last n tokens, longest n first and latest match
    first, and propose what followed each; distinct continuations only, from different matches."""
    length, found = sequence_ids.shape[0], []
    for size in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = sequence_ids[: length - 1].unfold(0, size, 1)  # [T-size, size] every earlier n-gram
        starts = (windows == sequence_ids[length - size :]).all(dim=1).nonzero().flatten() + size  # [matches]
        for start in starts.flip(0).tolist():
            continuation = sequence_ids[start : start + num_draft_tokens].tolist()
            if continuation not in found:
                found.append(continuation)
            if len(found) == num_candidates:
                return found
    return found


class NgramDrafter:
    """Prompt-lookup drafting: no model, no cache; copies text that follows matching n-grams. With W > 1 it also
    follows one-token matches once the longer ones run out: one candidate from such a match is mostly wrong, but W of
    them checked in the same pass often hold the next token (tokens per pass in BENCHMARKS.md's batch bench)."""

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 2) -> None:
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size  # min: for W = 1

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [
            Draft(
                find_ngram_continuations(
                    torch.tensor(r.sequence_ids, device="cpu"),  # a lookup on the host
                    r.num_draft_tokens,
                    r.num_candidates,
                    self.max_ngram_size,
                    self.min_ngram_size if r.num_candidates == 1 else 1,
                )
                if r.num_draft_tokens
                else [],
                None,
            )
            for r in requests
        ]

    def forget(self, key: Hashable) -> None:
        pass
