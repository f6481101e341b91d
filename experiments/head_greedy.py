"""Heads measured where greedy decoding takes them: the target answers the held-out instructions (the last chunks of
train-drafter's order, never trained on) greedily, and each head drafts greedily from every position of those answers.
On a greedy text the text always goes on with the target's argmax, so α per draft position and tokens per pass here
are those of greedy speculative decoding from every position, on 13,000-odd positions: a finer measure of T = 0 than
a few fresh prompts, and one that train-drafter's held-out figures (on sampled texts) are not.

    python -m experiments.head_greedy --heads A.pt B.pt ... >> rows.jsonl
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from benchmarks.common import load, parser
from specdemo.drafters.head_file import head_path, load_head, target_fingerprint
from specdemo.models.offline import cache_root
from specdemo.training.data import DataSettings, texts_written, write_chunk, write_features
from specdemo.training.fit import held_out_acceptance, read_positions
from specdemo.training.instructions import instructions, pool_digest


def greedy_texts(target, cache: Path, span: str, layers: tuple[int, ...], new_tokens: int) -> list[Path]:
    """The greedy answers to the instructions of train-drafter's chunks `span` (written here where missing)."""
    sampled = DataSettings()
    greedy = replace(sampled, temperature=0.0, max_new_tokens=new_tokens)
    texts, size = instructions(sampled.num_texts, sampled.seed), sampled.batch_size
    first, last = map(int, span.split("-"))
    paths = []
    for index in range(first, last + 1):
        path = cache / f"greedy-held-out-{pool_digest()}-{new_tokens}" / f"texts-{index:04d}.pt"  # this pool's
        if not texts_written(path, greedy):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_chunk(target, texts[index * size : (index + 1) * size], greedy, path, seed=0, layers=layers)
        paths.append(path)
    write_features(target, paths, layers)  # where written for other layers, or by an earlier format
    return paths


def main(argv: list[str] | None = None) -> list[dict]:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--heads", nargs="+", type=Path, help="head files (default: the shipped one)")
    flags.add_argument("--held-out", default="58-59", help="train-drafter's held-out chunks")
    flags.add_argument("--new-tokens", type=int, default=DataSettings.max_new_tokens)
    flags.add_argument("--cache", type=Path, default=cache_root() / "training")
    args = flags.parse_args(argv)
    target = load(args)
    fingerprint = target_fingerprint(target.model)
    cache = args.cache / f"{target.name.replace('/', '--')}-{fingerprint}-{args.dtype}"
    rows = []
    for path in args.heads or [head_path(target.name)]:
        head = load_head(target.model, path).float()
        texts = greedy_texts(target, cache, args.held_out, head.shape.layers, args.new_tokens)
        positions = read_positions(texts, head.shape.layers, 4)
        alpha, per_pass = held_out_acceptance(head, positions, limit=len(positions.hidden))
        row = dict(head=str(path), positions=len(positions.hidden), alpha=[round(a, 3) for a in alpha],
                   tokens_per_pass=round(per_pass, 3))  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
