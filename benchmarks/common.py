"""What the benchmarks share: the flags that pick a model and its number format, loading it, and HF's greedy
`generate` as the peer (the tests' too)."""

from __future__ import annotations

import argparse

import torch
from transformers import PreTrainedModel

from specdemo import OFFLINE_DEFAULT, LoadedModel, load_model


def parser(description: str) -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(description=description)
    flags.add_argument("--model", default=OFFLINE_DEFAULT, help="an offline name, a Hub id or a directory")
    flags.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    return flags


def load(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, device=torch.device("cpu"), dtype=args.dtype, allow_local=True)


def hf_greedy(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,  # [1, T]
    max_new_tokens: int,
    eos: frozenset[int] | None = None,  # the EOS our loop was given; None: the model's generation config decides
    **settings: object,
) -> list[int]:
    """The peer: model.generate(do_sample=False), stopping at the same EOS as our loops (no min_new_tokens unless
    `settings` ask for it, so it suppresses nothing our loops would emit)."""
    stopping = {} if eos is None else {"eos_token_id": sorted(eos), "pad_token_id": min(eos)}
    with torch.inference_mode():
        output = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **stopping,
            **settings,
        )  # [1, T + new]
    return output[0, prompt_ids.shape[1] :].tolist()
