"""Does the head draft better when it can look back over the whole text (EAGLE's attention) rather than read the last
position's states alone? Two variants, fitted alike on train-drafter's cached texts, in batches of whole texts:
`last`, today's head (c_t = F[states at t]), and `context`, c_t = F[states at t] + W_o Attn(z_{<=t}) with
z_j = norm(W_z [F[states at j] ; e(x_{j+1})]): one causal attention layer with rotary positions over every position of
the text, the prompt included, W_o starting at zero, so it starts as `last` and gains only what attention finds. Both
then draft through the same RNN (soft labels, teacher forcing, K = 4). Measured greedily against the target's argmax
(α per draft position, tokens per pass of one chain) on the held-out texts, and on the target's greedy answers to each
--prompts file, open-ended and grounded apart (answers written here, under the cache, where missing). The shipped
head, where it reads the same layers, is measured on the same answers first. One JSON line per head.

    PYTHONPATH=. .venv/bin/python benchmarks/head_context.py --steps 900 --texts-per-step 8 \\
        --prompts benchmarks/prompts/head-fresh-5.jsonl benchmarks/prompts/head-review-5.jsonl
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import chunks, load, parser
from specdemo import load_prompts
from specdemo.drafters.recurrent import RecurrentHead, head_path, layer_indices, load_head, target_fingerprint
from specdemo.models import onednn
from specdemo.models.offline import cache_root
from specdemo.training.data import IGNORE, DataSettings, features_paths, texts_written, write_chunk, write_texts
from specdemo.training.fit import (
    FitSettings,
    _rate,
    held_out_acceptance,
    read_positions,
    sub_vocabulary,
    training_loss,
)

# T = a text's length, B = texts in a batch, L = layers read, H = hidden size


class Context(nn.Module):
    """What the RNN reads at each position: the layers' states fused (F, as RecurrentHead.read), plus, with `attend`,
    what one causal attention layer finds over the text's positions up to it."""

    def __init__(self, target, num_layers: int, attend: bool) -> None:
        super().__init__()
        hidden = target.config.hidden_size
        self.hidden, self.num_layers, self.attend = hidden, num_layers, attend
        self.heads = max(1, hidden // 64)
        self.register_buffer("embedding", target.get_input_embeddings().weight.detach(), persistent=False)
        self.fuse = nn.Linear(num_layers * hidden, hidden, bias=False)
        if attend:
            self.input = nn.Linear(2 * hidden, hidden, bias=False)
            self.norm = nn.RMSNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * self.heads * 64, bias=False)
            self.out = nn.Linear(self.heads * 64, hidden, bias=False)
            nn.init.zeros_(self.out.weight)

    def forward(self, states: torch.Tensor, next_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, L*H] states, [B, T] x_{j+1}, [B, T] bool real positions -> [B, T, H]."""
        parts = states.unflatten(-1, (self.num_layers, self.hidden)).float()
        fused = self.fuse((parts * torch.rsqrt(parts.square().mean(dim=-1, keepdim=True) + 1e-6)).flatten(-2))
        if not self.attend:
            return fused
        embedded = nn.functional.embedding(next_tokens, self.embedding).to(fused.dtype)
        z = self.norm(self.input(torch.cat([fused, embedded], dim=-1)))
        batch, length, _ = z.shape
        q, k, v = self.qkv(z).view(batch, length, 3, self.heads, 64).permute(2, 0, 3, 1, 4)  # each [B, heads, T, 64]
        causal = torch.ones(length, length, dtype=torch.bool, device=z.device).tril()
        found = nn.functional.scaled_dot_product_attention(
            rotary(q), rotary(k), v, attn_mask=causal[None, None] & mask[:, None, None, :]
        )
        return fused + self.out(found.transpose(1, 2).flatten(2))


def rotary(x: torch.Tensor) -> torch.Tensor:  # [..., T, d] rotated by position
    half = x.shape[-1] // 2
    rates = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = torch.arange(x.shape[-2], dtype=torch.float32, device=x.device)[:, None] * rates  # [T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Texts:
    """Chunks' texts whole (tokens and every position's states) beside their trainable positions, whose rows
    read_positions lays out text after text."""

    def __init__(self, paths: list[Path], layers: tuple[int, ...], depth: int) -> None:
        self.positions = read_positions(paths, layers, depth)
        self.texts, self.offsets = [], [0]
        for path in paths:
            record, files = torch.load(path, weights_only=True), features_paths(path, layers)
            states = [torch.load(files[f"layer {layer}"], weights_only=True)["hidden"] for layer in layers]
            for b, tokens in enumerate(record["token_ids"]):
                start = record["prompt_lengths"][b] - 1
                if len(tokens) - start >= 2:
                    whole = torch.cat([s[b] for s in states], dim=-1)  # [T-1, L*H] positions 0..T-2
                    self.texts.append((tokens.long(), whole, start))
                    self.offsets.append(self.offsets[-1] + len(tokens) - start - 1)

    def batch(self, context: Context, chosen: list[int]) -> dict[str, torch.Tensor]:
        """The chosen texts' trainable positions: what the RNN reads there (`hidden`), and their labels."""
        length = max(len(self.texts[i][0]) - 1 for i in chosen)
        states = torch.zeros(len(chosen), length, self.texts[chosen[0]][1].shape[-1], dtype=torch.bfloat16)
        following = torch.zeros(len(chosen), length, dtype=torch.long)
        mask = torch.zeros(len(chosen), length, dtype=torch.bool)
        for b, i in enumerate(chosen):
            tokens, whole, _ = self.texts[i]
            states[b, : len(whole)], following[b, : len(whole)], mask[b, : len(whole)] = whole, tokens[1:], True
        read = context(states, following, mask)
        spans = [(self.texts[i][2], self.offsets[i + 1] - self.offsets[i]) for i in chosen]
        rows = torch.cat([torch.arange(self.offsets[i], self.offsets[i + 1]) for i in chosen])
        names = ("inputs", "argmax", "follows", "top_probs", "top_ids")
        return {name: getattr(self.positions, name)[rows] for name in names} | {
            "hidden": torch.cat([read[b, start : start + count] for b, (start, count) in enumerate(spans)])
        }

    @torch.inference_mode()
    def acceptance(self, context: Context, head: RecurrentHead) -> dict[str, object]:
        """Greedy drafts from every position against the target's argmax, as fit's held-out figures are counted: α
        per draft position and tokens per pass of one chain."""
        batches = [list(range(first, min(first + 16, len(self.texts)))) for first in range(0, len(self.texts), 16)]
        read = torch.cat([self.batch(context, chosen)["hidden"] for chosen in batches])
        alpha, per_pass = held_out_acceptance(head, replace(self.positions, hidden=read), limit=len(read))
        return dict(positions=len(read), alpha=[round(a, 3) for a in alpha], tokens_per_pass=round(per_pass, 3))


class Shipped(nn.Module):
    """The shipped head's own fusion, as a Context without attention."""

    def __init__(self, head: RecurrentHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, states: torch.Tensor, next_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head.read(states.float())


def answers(target, cache: Path, path: Path, layers: tuple[int, ...], new_tokens: int) -> dict[str, list[Path]]:
    """The target's greedy answers to a prompts file, open-ended and grounded apart (written where missing)."""
    greedy = replace(DataSettings(), temperature=0.0, max_new_tokens=new_tokens)
    prompts = load_prompts(path)
    kinds = {
        "open-ended": [p.text for p in prompts if not p.grounded],
        "grounded": [p.text for p in prompts if p.grounded],
    }
    written = {}
    for kind, texts in kinds.items():
        if not texts:
            continue
        written[kind] = []
        for index in range(0, len(texts), greedy.batch_size):
            chunk = cache / "greedy-answers" / f"{path.stem}-{kind}" / f"texts-{index // greedy.batch_size:04d}.pt"
            if not texts_written(chunk, greedy):
                chunk.parent.mkdir(parents=True, exist_ok=True)
                write_chunk(target, texts[index : index + greedy.batch_size], greedy, chunk, seed=0, layers=layers)
            written[kind].append(chunk)
    return written


def main(argv: list[str] | None = None) -> list[dict]:
    onednn.uncap()  # as train-drafter runs (specdemo/models/onednn.py)
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--texts", type=int, default=DataSettings.num_texts, help="sampled texts written")
    flags.add_argument("--new-tokens", type=int, default=DataSettings.max_new_tokens)
    flags.add_argument("--layers", default="15,22,30", help="the target's hidden states read")
    flags.add_argument("--train", default="0-116", help="the sampled chunks trained on")
    flags.add_argument("--held-out", default="117-119")
    flags.add_argument("--steps", type=int, default=900)
    flags.add_argument("--texts-per-step", type=int, default=8)
    flags.add_argument("--variants", nargs="+", default=["last", "context"], choices=["last", "context"])
    flags.add_argument("--prompts", nargs="*", type=Path, default=[], help="prompts files answered greedily")
    flags.add_argument("--cache", type=Path, default=cache_root() / "training")
    args = flags.parse_args(argv)
    target = load(args)
    model = target.model
    cache = args.cache / f"{target.name.replace('/', '--')}-{target_fingerprint(model)}-{args.dtype}"
    layers = layer_indices(model, tuple(int(layer) for layer in args.layers.split(",")))
    settings = FitSettings(steps=args.steps, layers=layers)
    write_texts(target, DataSettings(num_texts=args.texts, max_new_tokens=args.new_tokens), cache, layers)
    train = Texts(chunks(cache, args.train), layers, settings.depth)
    sets = {"held-out": Texts(chunks(cache, args.held_out), layers, settings.depth)}
    for path in args.prompts:
        for kind, written in answers(target, cache, path, layers, args.new_tokens).items():
            sets[f"{path.stem} {kind}"] = Texts(written, layers, settings.depth)
    rows = []
    shipped_path = head_path(target.name)
    shipped = load_head(model, shipped_path).float() if shipped_path.is_file() else None
    if shipped is not None and shipped.shape.layers == layers:  # on the same states
        rnn = RecurrentHead(model, shipped.vocabulary, shipped.shape.num_blocks).float()  # the same RNN, no fusion
        rnn.load_state_dict({k: v for k, v in shipped.state_dict().items() if not k.startswith("fuse")})
        rows.append({"head": "shipped"} | {name: s.acceptance(Shipped(shipped), rnn) for name, s in sets.items()})
        print(json.dumps(rows[-1]), flush=True)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocabulary = sub_vocabulary(train.positions, settings.vocabulary_size, vocab_size)
    lookup = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    lookup[vocabulary] = torch.arange(len(vocabulary))
    low_precision = model.dtype == torch.bfloat16
    for variant in args.variants:
        torch.manual_seed(0)
        context = Context(model, len(layers), variant == "context")
        head = RecurrentHead(model, vocabulary, settings.num_blocks).float()  # reads `hidden` as given
        optimizer = torch.optim.AdamW([*context.parameters(), *head.parameters()], lr=1e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _rate(step, settings))
        generator = torch.Generator().manual_seed(0)
        started = time.perf_counter()
        for _ in range(args.steps):
            chosen = torch.randint(len(train.texts), (args.texts_per_step,), generator=generator).tolist()
            with torch.autocast("cpu", torch.bfloat16, enabled=low_precision):
                loss = training_loss(head, train.batch(context, chosen), lookup, settings)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        context.eval(), head.eval()
        row = dict(head=variant, steps=args.steps, texts_per_step=args.texts_per_step, final_loss=round(loss.item(), 3),
                   seconds=round(time.perf_counter() - started))  # fmt: skip
        rows.append(row | {name: s.acceptance(context, head) for name, s in sets.items()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
