"""The engine's KV-cached forward: a cache that drops rejected draft positions, past sliding windows too."""

# B = batch, T = sequence length, N = positions whose logits are kept, V = vocab_size

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel


def rollback_cache(model: PreTrainedModel) -> DynamicCache:
    """A KV cache that can drop rejected positions, set up as transformers' assisted generation sets up its own:
    the model's layer types (sliding-window layers keep their window), with past recording on, so that a sliding
    layer keeps the states a crop needs even past its window (without it, crop raises there)."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def check_rollback(name: str, cache: DynamicCache) -> None:
    """Refuse a model whose cache, after a forward pass, cannot drop positions: speculative decoding rolls back
    after every rejection, and a recurrent state (Mamba, linear attention) cannot be cropped."""
    if not cache.is_croppable or cache.get_seq_length() == 0:
        raise ValueError(
            f"'{name}' keeps a recurrent state (or no KV cache) that cannot be rolled back after a rejected draft "
            "token, so it cannot take part in speculative decoding here: pick an attention-only model."
        )


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer around it measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class KVCachedModel:
    """A model with its own KV cache that always holds a prefix of the last sequence it was given.

    Rollback is implicit: a call crops the cache to the longest prefix it shares with the new sequence,
    so rejected draft tokens vanish from the cache before the next forward pass.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.device
        self.cache = rollback_cache(model)
        self.cached_ids = torch.empty(1, 0, dtype=torch.long, device=self.device)  # [B, T_cached]
        self.uncropped_length = 0  # tokens fed since the last crop: the deepest crop a sliding layer can undo
        self.forward_seconds = 0.0  # total time inside model forward passes, for the overhead figures
        self.last_input_length = 0  # tokens fed in the latest pass (the whole prompt in the first)
        self.last_forward_seconds = 0.0

    def common_prefix_length(self, sequence_ids: torch.Tensor) -> int:  # [B, T]
        length = min(self.cached_ids.shape[1], sequence_ids.shape[1])
        same = (self.cached_ids[:, :length] == sequence_ids[:, :length]).all(dim=0)  # [length]
        return length if bool(same.all()) else int(same.long().argmin())

    def rollback(self, length: int) -> None:
        """Drop cached positions from `length` on (DynamicCache.crop takes the negative count).

        A crop shrinks sliding-window layers back to their window, so a later crop can only undo the tokens fed
        since; a deeper rollback (never needed by the decoding loops) starts over from an empty cache."""
        excess = self.cached_ids.shape[1] - length
        if excess > self.uncropped_length:
            self.cache, self.cached_ids = rollback_cache(self.model), self.cached_ids[:, :0]
            self.uncropped_length = 0
        elif excess > 0:
            self.cache.crop(-excess)
            self.cached_ids = self.cached_ids[:, :length]
            self.uncropped_length = 0

    @torch.inference_mode()
    def logits(
        self,
        sequence_ids: torch.Tensor,  # [B, T] the whole sequence; only the uncached tail is computed
        num_logits: int,  # N: logits are returned for the last N positions
    ) -> torch.Tensor:  # [B, N, V]
        # At least one token is always fed, so the last position's logits are fresh.
        self.rollback(min(self.common_prefix_length(sequence_ids), sequence_ids.shape[1] - 1))
        new_ids = sequence_ids[:, self.cached_ids.shape[1] :]  # [B, T - T_cached]
        assert new_ids.shape[1] >= num_logits, f"asked for {num_logits} logits but feeding {new_ids.shape[1]} tokens"
        started = time.perf_counter()
        output = self.model(input_ids=new_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=num_logits)
        synchronize(self.device)
        self.last_forward_seconds = time.perf_counter() - started
        self.forward_seconds += self.last_forward_seconds
        self.cached_ids = sequence_ids
        self.uncropped_length += new_ids.shape[1]
        self.last_input_length = new_ids.shape[1]
        return output.logits
