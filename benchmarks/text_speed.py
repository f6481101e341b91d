"""How fast the target writes train-drafter's texts, by batch size and number format: the answer tokens (up to each
text's EOS) written per second by Hugging Face `generate`, sampled as train-drafter samples them, on the same
instructions for every setting. As train-drafter does, each setting records the features of the default head's layers
while writing; a setting ending in `:plain` writes the texts alone, to measure what recording costs. --sampler times
one draw for a batch, do_sample's torch.multinomial against train-drafter's inverse CDF, on the target's own scores.
--requests times the target writing requests of its own (`--instructions target`), a batch at a time.

    python -m benchmarks.text_speed --texts 64 --settings bfloat16:16 bfloat16:32 bfloat16:64
    python -m benchmarks.text_speed --sampler --settings bfloat16:32
    python -m benchmarks.text_speed --requests 3 --settings bfloat16:32
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks.common import parser
from specdemo import load_model
from specdemo.drafters.head import layer_indices
from specdemo.models import onednn
from specdemo.models.loading import chat_prompt_ids
from specdemo.training.data import DataSettings, InverseCDFSampler, generate_texts
from specdemo.training.fit import default_layers
from specdemo.training.instructions import instructions
from specdemo.training.requests import write_batch


def main(argv: list[str] | None = None) -> list[dict]:
    onednn.uncap()  # as train-drafter runs (specdemo/models/onednn.py)
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--texts", type=int, default=64)
    flags.add_argument("--new-tokens", type=int, default=DataSettings.max_new_tokens)
    flags.add_argument("--settings", nargs="+", default=["bfloat16:16", "bfloat16:32", "bfloat16:64"],
                       help="dtype:batch_size[:plain], measured in this order")  # fmt: skip
    flags.add_argument("--sampler", action="store_true", help="time one draw of each sampler instead")
    flags.add_argument("--requests", type=int, metavar="BATCHES", help="time this many batches of requests instead")
    args = flags.parse_args(argv)
    texts, rows = instructions(args.texts, 0), []
    if args.sampler:
        return [sampler_row(args.model, setting, texts) for setting in args.settings]
    if args.requests:
        return [requests_row(args.model, setting, args.requests) for setting in args.settings]
    for setting in args.settings:
        dtype_name, batch_size, *plain = setting.split(":")
        target = load_model(args.model, device=torch.device("cpu"), dtype=getattr(torch, dtype_name))
        layers = () if plain else layer_indices(target.model, default_layers(target.model))
        settings = DataSettings(num_texts=max(16, args.texts), max_new_tokens=args.new_tokens,
                                batch_size=int(batch_size))  # fmt: skip
        prompts = [chat_prompt_ids(target, text)[0] for text in texts]
        started, written = time.perf_counter(), 0
        for first in range(0, len(prompts), settings.batch_size):
            batch = prompts[first : first + settings.batch_size]
            sequences, _ = generate_texts(target, batch, settings, seed=first, layers=layers)
            written += sum(len(s) - len(p) for s, p in zip(sequences, batch, strict=True))
        seconds = time.perf_counter() - started
        row = dict(dtype=dtype_name, batch_size=int(batch_size), layers=list(layers), texts=len(prompts),
                   answer_tokens=written, seconds=round(seconds, 1),
                   tokens_per_second=round(written / seconds, 1))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def requests_row(model: str, setting: str, batches: int) -> dict:
    """Requests the target writes itself at this setting's batch size: kept a second, over `batches` batches after
    one to warm up."""
    dtype_name, batch_size = setting.split(":")[:2]
    target = load_model(model, device=torch.device("cpu"), dtype=getattr(torch, dtype_name))
    write_batch(target, int(batch_size), seed=-1)
    started, kept = time.perf_counter(), 0
    for index in range(batches):
        kept += len(write_batch(target, int(batch_size), seed=index))
    seconds = time.perf_counter() - started
    row = dict(dtype=dtype_name, batch_size=int(batch_size), batches=batches, requests_kept=kept,
               seconds=round(seconds, 1), requests_per_second=round(kept / seconds, 2))  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def sampler_row(model: str, setting: str, texts: list[str], repeats: int = 21) -> dict:
    """One draw for B texts from the target's scores after their prompts, each sampler in turn: medians, in ms."""
    dtype_name, batch_size, *_ = setting.split(":")
    target = load_model(model, device=torch.device("cpu"), dtype=getattr(torch, dtype_name))
    prompts = [chat_prompt_ids(target, text)[0] for text in texts[: int(batch_size)]]
    with torch.inference_mode():
        scores = torch.stack([target.model(p[None]).logits[0, -1].float() for p in prompts])  # [B, V]
    temperature = DataSettings.temperature
    samplers = {
        "multinomial": lambda: torch.multinomial((scores / temperature).softmax(dim=-1), 1),
        "inverse_cdf": lambda: InverseCDFSampler(temperature)(None, scores),
    }
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(repeats):
        for name, draw in samplers.items():
            started = time.perf_counter()
            draw()
            times[name].append((time.perf_counter() - started) * 1000)
    row = dict(dtype=dtype_name, batch_size=len(prompts), vocabulary=scores.shape[-1], repeats=repeats)
    row |= {f"{name}_ms": round(statistics.median(values), 2) for name, values in times.items()}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
