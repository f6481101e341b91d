"""Fitting the recurrent head on the target's own texts: from each position t, given the target's hidden states h_t (the
layers it reads) and the token x_{t+1} it chose, the head learns the target's next K predictions (its argmax, or its
top entries as soft labels), reading the text's tokens (teacher forcing) or its own drafts (training-time test).
Checkpointed, so an interrupted run resumes; held-out acceptance per draft position is measured as it goes."""

# N = training positions, K = depth (draft positions trained), H = hidden_size, F = the layers read side by side
# (layers x H), U = sub-vocabulary,
# A = TOP_ENTRIES

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from specdemo.config import check_int, check_number
from specdemo.drafters.head import RecurrentHead
from specdemo.training.data import IGNORE, features_paths  # IGNORE: no label (off the sub-vocabulary, past the end)

LABELS = ("argmax", "soft")
UNROLLS = ("teacher", "drafts", "both")  # what positions 2..K read in training: see training_loss
LAYER_FRACTIONS = (0.5, 0.75)  # the two layers read beside the final state, as fractions of the depth: on
# SmolLM2-135M's 30 layers, 15 and 22 drafted best of five choices (docs/recurrent-drafter.md)


def default_layers(target: PreTrainedModel) -> tuple[int, ...]:
    """A middle, a late and the final (normed) state: hidden_states indices for this target's depth."""
    depth = target.config.num_hidden_layers
    return tuple(dict.fromkeys([*(max(1, round(depth * fraction)) for fraction in LAYER_FRACTIONS), depth]))


@dataclass(frozen=True)
class FitSettings:
    steps: int = 6000  # +0.08 tokens per pass over 4,000 on fresh prompts, with 407k positions (docs/)
    batch_size: int = 256  # positions a step, each trained over `depth` draft positions
    depth: int = 4
    vocabulary_size: int = 8192  # U: measured, see docs/recurrent-drafter.md
    num_blocks: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    labels: str = "soft"  # the target's top entries: +0.055 tokens per pass over its argmax, greedy (docs/)
    layers: tuple[int, ...] = ()  # the target's hidden states the head reads (hidden_states indices); () the default
    unroll: str = "teacher"
    held_out_texts: int = 96  # the last texts written, never trained on
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 1, 1_000_000)
        check_int("batch-size", self.batch_size, 1, 65_536)
        check_int("depth", self.depth, 1, 16)
        check_int("vocabulary-size", self.vocabulary_size, 16, 262_144)
        check_int("blocks", self.num_blocks, 0, 8)
        check_number("learning-rate", self.learning_rate, 0.0, 1.0, low_open=True)
        check_number("weight-decay", self.weight_decay, 0.0, 1.0)
        check_int("held-out-texts", self.held_out_texts, 1, 10_000)
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}.")
        if self.unroll not in UNROLLS:
            raise ValueError(f"unroll must be one of {', '.join(UNROLLS)}, got {self.unroll!r}.")
        if len(self.layers) > 8 or len(set(self.layers)) < len(self.layers):
            raise ValueError(f"layers must be at most 8 different layers, got {list(self.layers)}.")


@dataclass
class Positions:
    """Every trainable position of a set of texts: what the head reads, and what it should predict."""

    hidden: torch.Tensor  # [N, F] bfloat16 h_t, the layers' states concatenated
    inputs: torch.Tensor  # [N, K] int64 x_{t+1} ... x_{t+K} (0 past the end)
    argmax: torch.Tensor  # [N, K] int64 the target's argmax at t+1 ... t+K (IGNORE past the end)
    follows: torch.Tensor  # [N, K] bool the text went on with that argmax (x_{t+k+1} == argmax_{t+k})
    top_probs: torch.Tensor  # [N, K, A] float16
    top_ids: torch.Tensor  # [N, K, A] int64


def read_positions(chunks: list[Path], layers: tuple[int, ...], depth: int) -> Positions:
    """Positions t from each text's last prompt token to its second-to-last token (data wrote the chunks' features for
    these layers, as indices into hidden_states: states at 0..T-2, labels at P..T-1). The states are written into one
    tensor sized from the texts first: gathering them and concatenating would hold them twice."""
    texts = [torch.load(path, weights_only=True) for path in chunks]
    spans = [[(p - 1, len(t)) for p, t in zip(r["prompt_lengths"], r["token_ids"], strict=True)] for r in texts]
    count = sum(length - start - 1 for chunk in spans for start, length in chunk if length - start >= 2)
    hidden = None
    filled = 0
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in Positions.__dataclass_fields__ if name != "hidden"}
    for path, record, chunk in zip(chunks, texts, spans, strict=True):
        files = features_paths(path, layers)
        record = record | torch.load(files["labels"], weights_only=True)["labels"]
        states = [torch.load(files[f"layer {layer}"], weights_only=True)["hidden"] for layer in layers]
        if hidden is None:
            hidden = torch.empty(count, sum(s[0].shape[-1] for s in states), dtype=states[0][0].dtype, device="cpu")
        for b, (start, length) in enumerate(chunk):
            if length - start < 2:
                continue
            tokens = record["token_ids"][b]
            t = torch.arange(start, length - 1, device="cpu")  # [n] positions are read on the host
            ahead = t[:, None] + torch.arange(1, depth + 1, device="cpu")  # [n, K] t+k
            inside = ahead < length
            at = ahead.clamp(max=length - 1)
            argmax = record["argmax"][b].long()
            label = at - start - 1  # [n, K] rows of the labels, which begin at the answer's first position
            after = torch.cat([tokens.long(), torch.tensor([-1], device="cpu")])[at + 1]  # x_{t+k+1}; -1 past the end
            torch.cat([state[b][start : length - 1] for state in states], dim=-1, out=hidden[filled : filled + len(t)])
            filled += len(t)
            columns["inputs"].append(torch.where(inside, tokens.long()[at], 0))
            columns["argmax"].append(torch.where(inside, argmax[label], IGNORE))
            columns["follows"].append(inside & (after == argmax[label]))
            columns["top_probs"].append(record["top_probs"][b][label])
            columns["top_ids"].append(record["top_ids"][b][label].long())
    assert hidden is not None and filled == count, "the texts' positions and their states disagree"
    return Positions(hidden=hidden, **{name: torch.cat(parts) for name, parts in columns.items()})


def sub_vocabulary(positions: Positions, size: int, vocab_size: int) -> torch.Tensor:  # [U] ids, most frequent first
    """The tokens the target predicts most often in its texts (FR-Spec's frequency ranking)."""
    labels = positions.argmax[:, 0]
    counts = torch.bincount(labels[labels >= 0], minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[: min(size, vocab_size)]


@dataclass
class Curves:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # training loss, averaged since the previous point
    alpha: list[list[float]] = field(default_factory=list)  # held-out acceptance per draft position, greedy
    tokens_per_pass: list[float] = field(default_factory=list)  # held-out, greedy, one chain of `depth`


@torch.inference_mode()
def held_out_acceptance(head: RecurrentHead, positions: Positions, limit: int = 4096) -> tuple[list[float], float]:
    """Greedy drafts of `depth` tokens from held-out positions against the target's argmax: α per draft position
    (accepted over reached), and tokens per target pass of one chain (1 + accepted), as the engine would count."""
    chosen = torch.linspace(0, len(positions.hidden) - 1, min(limit, len(positions.hidden)), device="cpu").long()
    depth, device = positions.inputs.shape[1], head.output_rows.device
    hidden, inputs = positions.hidden[chosen].to(device).float(), positions.inputs[chosen, 0].to(device)
    drafts = head.beam_search(hidden, inputs, 1, depth)[:, 0].cpu()
    accepted = drafts == positions.argmax[chosen]  # [n, K]
    # A drafted token's successor can be judged only where the text went on with it (its own context).
    goes_on = (accepted & positions.follows[chosen]).long().cumprod(dim=1)  # [n, K]
    reached = torch.cat([torch.ones_like(goes_on[:, :1]), goes_on[:, :-1]], dim=1).bool()  # [n, K]
    alpha = [float((accepted & reached)[:, k].sum() / reached[:, k].sum().clamp(min=1)) for k in range(depth)]
    return alpha, 1.0 + float((accepted & reached).sum(dim=1).float().mean())


def training_loss(head: RecurrentHead, batch: dict[str, torch.Tensor], lookup: torch.Tensor, settings: FitSettings):
    """Teacher forcing: every position reads the text's tokens. Drafts (training-time test): positions 2..K read the
    head's own greedy drafts, and a position is trained only where the drafts before it were the target's argmax and
    the text went on with them (elsewhere the label was made in another context, and drafting never gets there).
    Both: the mean of the two."""
    if settings.unroll == "both":
        halves = [replace(settings, unroll=unroll) for unroll in ("teacher", "drafts")]
        return sum(training_loss(head, batch, lookup, half) for half in halves) / 2
    drafts = settings.unroll == "drafts"
    logits = head(batch["hidden"].float(), batch["inputs"], own_drafts=drafts)  # [B, K, U]
    valid = batch["argmax"] >= 0  # [B, K]
    if drafts:
        drafted = head.vocabulary[logits.argmax(dim=-1)]  # [B, K]
        goes_on = ((drafted == batch["argmax"]) & batch["follows"]).long().cumprod(dim=1)
        valid &= torch.cat([torch.ones_like(goes_on[:, :1]), goes_on[:, :-1]], dim=1).bool()
    if settings.labels == "argmax":
        target = lookup[batch["argmax"].clamp(min=0)].masked_fill(~valid, IGNORE)  # [B, K] in U
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)
    index = lookup[batch["top_ids"]]  # [B, K, A] in U, or IGNORE off the sub-vocabulary
    weights = batch["top_probs"].float() * (index >= 0) * valid[..., None]
    log_q = logits.log_softmax(dim=-1).gather(-1, index.clamp(min=0))  # [B, K, A]
    return -(weights * log_q).sum() / weights.sum().clamp(min=1e-9)


def _rate(step: int, settings: FitSettings) -> float:
    """Linear warm-up over the first tenth, then cosine decay to zero (ReDrafter's schedule)."""
    warmup = max(1, settings.steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, settings.steps - warmup)))


def fit(
    target: PreTrainedModel,
    train: Positions,
    held_out: Positions,
    settings: FitSettings,
    checkpoint: Path,
    evaluate_every: int = 250,
    made_from: str = "",
    low_precision: bool | None = None,
) -> tuple[RecurrentHead, Curves]:
    """Train a head, resuming from `checkpoint` when it was made with the same settings from the same texts
    (`made_from` names them). Its weights stay float32; its products run in bfloat16 where the target's format is
    bfloat16 (or as `low_precision` says): 1.9x faster a step on this CPU, the same held-out figures
    (docs/recurrent-drafter.md)."""
    torch.manual_seed(settings.seed)
    vocabulary = sub_vocabulary(train, settings.vocabulary_size, target.get_output_embeddings().weight.shape[0])
    head = RecurrentHead(target, vocabulary.to(target.device), settings.num_blocks, settings.layers)
    head = head.to(target.device).float()
    device = head.output_rows.device
    lookup = torch.full((head.embedding.shape[0],), IGNORE, dtype=torch.long, device=device)  # target id -> U
    lookup[vocabulary.to(device)] = torch.arange(len(vocabulary), device=device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _rate(step, settings))
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)  # picks batches of host positions
    curves, first_step = Curves(), 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        if saved["settings"] == asdict(settings) and saved.get("made_from") == made_from:
            head.load_state_dict(saved["head"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            generator.set_state(saved["generator"])
            curves, first_step = saved["curves"], saved["step"]
    batch_names = ("hidden", "inputs", "argmax", "follows", "top_probs", "top_ids")
    if device.type == "cuda":  # the host gathers a batch from its memory slower than the GPU trains on it
        train = Positions(**{name: getattr(train, name).to(device) for name in batch_names})
    running, counted = torch.zeros((), device=device), 0  # the loss summed on the device: read back at each point
    bar = tqdm(range(first_step, settings.steps), desc="training the head", unit="step", initial=first_step,
               total=settings.steps)  # fmt: skip
    low_precision = target.dtype == torch.bfloat16 if low_precision is None else low_precision
    for step in bar:
        chosen = torch.randint(len(train.hidden), (settings.batch_size,), generator=generator, device=generator.device)
        batch = {name: getattr(train, name)[chosen.to(train.hidden.device)].to(device) for name in batch_names}
        with torch.autocast(device.type, torch.bfloat16, enabled=low_precision):
            loss = training_loss(head, batch, lookup, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        running, counted = running + loss.detach(), counted + 1
        if (step + 1) % evaluate_every == 0 or step + 1 == settings.steps:
            alpha, per_pass = held_out_acceptance(head, held_out)
            curves.steps.append(step + 1)
            curves.loss.append(float(running) / counted)
            curves.alpha.append(alpha)
            curves.tokens_per_pass.append(per_pass)
            running, counted = torch.zeros((), device=device), 0
            bar.set_postfix(loss=f"{curves.loss[-1]:.3f}", alpha1=f"{alpha[0]:.2f}", per_pass=f"{per_pass:.2f}")
            state = dict(
                settings=asdict(settings),
                made_from=made_from,
                head=head.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                generator=generator.get_state(),
                curves=curves,
                step=step + 1,
            )
            torch.save(state, checkpoint.with_suffix(".partial"))
            checkpoint.with_suffix(".partial").replace(checkpoint)
    return head.eval(), curves
