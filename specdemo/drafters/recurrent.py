"""The recurrent drafter (ReDrafter, Cheng et al. 2024): a small RNN reads the target's hidden states at the last
accepted position (an early, a middle and the final layer's, fused by one linear layer as EAGLE-3 fuses them) and the
token the target just chose, and drafts what follows through the target's own tied LM head, restricted to the
sub-vocabulary the target writes most (FR-Spec). Written the seeds' way: `rnn_drafter` and `sample_seq` for one
sequence, lifted over beams and rows with torch.func.vmap; at temperature 0, beam search gives W deterministic
candidates.

Tokens outside the sub-vocabulary get q = 0 and are never drafted; q is the distribution the head sampled from (the
draft temperature over the sub-vocabulary), so the rule stays exact."""

# R = rows asking for drafts, W = num_candidates, K = num_draft_tokens, H = the target's hidden size,
# L = the target layers read, V = the target's vocab_size, S = the head's sub-vocabulary size

from __future__ import annotations

import hashlib
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.core.sampling import sample_one, uniforms_from
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.drafters.head_steps import HeadSteps

HEAD_FORMAT = "specdemo-recurrent-head/2"  # /2: reads `layers`; /1 read the final state alone
HEADS_DIRECTORY = Path(__file__).parent / "heads"  # the heads the project ships, one per offline target


@dataclass(frozen=True)
class RecurrentOptions:
    """None yet: the head's shape is its file's, and W and K are the run's."""


@dataclass(frozen=True)
class HeadShape:
    """What a head file records besides its weights."""

    hidden_size: int  # H, the target's
    num_blocks: int  # residual blocks x + SiLU(Linear(x)) at width 2H
    layers: tuple[int, ...]  # the target's hidden states it reads: indices into Hugging Face's hidden_states


def layer_indices(target: PreTrainedModel, layers: tuple[int, ...]) -> tuple[int, ...]:
    """`layers` as indices into the target's hidden_states (0 the embeddings, i layer i's output, the last the final
    normed state; -1 counts from the end), or a ValueError in one sentence."""
    count = target.config.num_hidden_layers + 1
    if not layers or any(not -count <= layer < count for layer in layers):
        raise ValueError(
            f"The head's layers {list(layers)} are not among the target's hidden states 0..{count - 1}: pick layers "
            f"of this target, or train a head for it with `python -m specdemo train-drafter`."
        )
    return tuple(layer % count for layer in layers)


class RecurrentHead(nn.Module):
    """h = F [n(h_a) ; n(h_b) ; h_L] (n: RMS-normalised; F one linear layer; with one layer, h is its state as it is);
    s_t = SiLU(W e(y_{t-1}) + U s_{t-1}), s_0 = 0; [h ; s_t] through residual blocks, projected to H and scored by
    the target's output embedding rows of the sub-vocabulary. The target's embeddings are frozen buffers, not saved."""

    def __init__(
        self, target: PreTrainedModel, vocabulary: torch.Tensor, num_blocks: int = 1, layers: tuple[int, ...] = (-1,)
    ) -> None:
        super().__init__()
        hidden = target.config.hidden_size
        layers = layer_indices(target, layers)
        embedding = target.get_input_embeddings().weight.detach()  # [V, H] the target's own tensor, not a copy
        output = target.get_output_embeddings().weight.detach()  # [V, H] (the same matrix when tied)
        self.register_buffer("vocabulary", vocabulary.long().clone())  # [S] target ids, most written first
        self.register_buffer("embedding", embedding, persistent=False)
        self.register_buffer("output_rows", output[vocabulary], persistent=False)  # [S, H]
        self.fuse = nn.Linear(len(layers) * hidden, hidden, bias=False) if len(layers) > 1 else None  # F
        self.input = nn.Linear(hidden, hidden)  # W, with a bias
        self.recurrent = nn.Linear(hidden, hidden, bias=False)  # U
        self.blocks = nn.ModuleList(nn.Linear(2 * hidden, 2 * hidden) for _ in range(num_blocks))
        self.project = nn.Linear(2 * hidden, hidden)
        self.shape = HeadShape(hidden, num_blocks, layers)
        self.trained: dict = {}  # how its file says it was trained, with its held-out figures

    def read(self, llm_states: torch.Tensor) -> torch.Tensor:  # [..., L*H] -> [..., H]
        """What the RNN reads of the target: its layers' states (as the engine concatenates them) fused into one."""
        if self.fuse is None:
            return llm_states
        parts = llm_states.unflatten(-1, (len(self.shape.layers), self.shape.hidden_size)).float()  # [..., L, H]
        parts = parts * torch.rsqrt(parts.square().mean(dim=-1, keepdim=True) + 1e-6)  # each layer at one scale
        return self.fuse(parts.flatten(-2).to(self.fuse.weight.dtype))

    def rnn_drafter(
        self,
        llm_state: torch.Tensor,  # [..., H] the target's last hidden state
        rnn_state: torch.Tensor,  # [..., H]
        input_token: torch.Tensor,  # [...] int64 target id
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [..., H] the next rnn_state, [..., S] logits over the sub-vocabulary
        """One step for one sequence (or any leading dimensions, as training feeds it)."""
        embedded = nn.functional.embedding(input_token, self.embedding)  # [..., H]
        rnn_state = nn.functional.silu(self.input(embedded) + self.recurrent(rnn_state))
        features = torch.cat([llm_state, rnn_state], dim=-1)  # [..., 2H]
        for block in self.blocks:
            features = features + nn.functional.silu(block(features))
        return rnn_state, self.project(features) @ self.output_rows.T

    def forward(
        self,
        llm_states: torch.Tensor,  # [N, L*H]
        input_tokens: torch.Tensor,  # [N, K] the token the target chose, then the K - 1 tokens that followed
        own_drafts: bool = False,  # read its own greedy drafts after the first token, as drafting does
    ) -> torch.Tensor:  # [N, K, S] logits of the K tokens after each input token (for training)
        """Teacher forcing reads the text's tokens; with own_drafts, step k reads the head's own argmax of step k-1
        (training-time test: what positions 2..K see when drafting)."""
        llm_states = self.read(llm_states)
        rnn_state, token = torch.zeros_like(llm_states), input_tokens[:, 0]
        logits = []
        for k in range(input_tokens.shape[1]):
            rnn_state, step = self.rnn_drafter(llm_states, rnn_state, token)
            logits.append(step)
            if k + 1 < input_tokens.shape[1]:
                token = self.vocabulary[step.argmax(dim=-1)] if own_drafts else input_tokens[:, k + 1]
        return torch.stack(logits, dim=1)

    def sample_seq(
        self,
        llm_state: torch.Tensor,  # [H] read(): the target's states fused
        llm_token: torch.Tensor,  # [] int64 the token the target chose
        uniforms: torch.Tensor,  # [K] float64, one draw per drafted token
        temperature: torch.Tensor,  # [] > 0
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [K] target ids, [K, S] q each was drawn from
        """One draft sequence, as the seeds write it; vmap adds the beam and row dimensions (sample_beams)."""
        rnn_state, token = torch.zeros_like(llm_state), llm_token
        tokens, probs = [], []
        for uniform in uniforms:
            rnn_state, logits = self.rnn_drafter(llm_state, rnn_state, token)
            q = (logits.float() / temperature).softmax(dim=-1)
            token = self.vocabulary[sample_one(q, uniform)]
            tokens.append(token)
            probs.append(q)
        return torch.stack(tokens), torch.stack(probs)

    def sample_beams(
        self,
        llm_states: torch.Tensor,  # [R, L*H]
        llm_tokens: torch.Tensor,  # [R] int64
        uniforms: torch.Tensor,  # [R, W, K] float64
        temperatures: torch.Tensor,  # [R]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [R, W, K] target ids, [R, W, K, S] q
        """W i.i.d. draft sequences per row: sample_seq lifted over beams (sharing the row's state), then rows."""
        over_beams = torch.func.vmap(self.sample_seq, in_dims=(None, None, 0, None))
        return torch.func.vmap(over_beams)(self.read(llm_states), llm_tokens, uniforms, temperatures)

    def beam_search(
        self,
        llm_states: torch.Tensor,  # [R, L*H]
        llm_tokens: torch.Tensor,  # [R] int64
        width: int,  # W <= S
        depth: int,  # K >= 1
    ) -> torch.Tensor:  # [R, W, K] target ids, the W most likely sequences under the head, most likely first
        """Temperature 0: deterministic candidates, which share their prefixes in the target's tree."""
        llm_states = self.read(llm_states)
        rnn_state, logits = self.rnn_drafter(llm_states, torch.zeros_like(llm_states), llm_tokens)
        scores, chosen = logits.float().log_softmax(dim=-1).topk(width, dim=-1)  # [R, W]
        sequences = chosen[..., None]  # [R, W, 1] sub-vocabulary indices
        rnn_state = rnn_state[:, None].expand(-1, width, -1)  # [R, W, H]
        states = llm_states[:, None].expand(-1, width, -1)
        for _ in range(depth - 1):
            rnn_state, logits = self.rnn_drafter(states, rnn_state, self.vocabulary[sequences[..., -1]])
            totals = (scores[..., None] + logits.float().log_softmax(dim=-1)).flatten(1)  # [R, W*S]
            scores, flat = totals.topk(width, dim=-1)  # [R, W]
            beams, tokens = flat // logits.shape[-1], flat % logits.shape[-1]
            sequences = torch.cat([sequences.gather(1, beams[..., None].expand_as(sequences)), tokens[..., None]], -1)
            rnn_state = rnn_state.gather(1, beams[..., None].expand_as(rnn_state))
        return self.vocabulary[sequences]


class RecurrentDrafter:
    """Drafts with a RecurrentHead from each row's hidden state (DraftRequest.hidden_state, which the engine fills
    because `reads_hidden_state`); a row without one yet (its first round) gets no draft. Sampled rows draw W
    i.i.d. sequences, greedy rows get beam search's W best. It counts how often each row's tokens are accepted at
    each draft position (the head's held-out figures as a prior), which is the chance it tells the planner: a row's
    chances, and so what the hybrid keeps of its drafts, are its own, the same in any batch."""

    reads_hidden_state = True
    PRIOR_WEIGHT = 20.0  # the prior counts as this many tested tokens at each position

    def __init__(self, head: RecurrentHead, vocab_size: int) -> None:
        self.head = head
        self.hidden_layers = head.shape.layers  # what the engine hands it (drafters.base.hidden_layers)
        self.vocab_size = vocab_size
        prior = list(head.trained.get("held_out_alpha") or [0.5])
        self.prior = [prior[min(k, len(prior) - 1)] for k in range(MAX_NUM_DRAFT_TOKENS)]  # K <= MAX_NUM_DRAFT_TOKENS
        self.counts: dict[Hashable, tuple[list[float], list[float]]] = {}  # per row and position: tested, accepted
        self.last: dict[Hashable, tuple[int, list[list[int]]]] = {}  # per row: its length then, and its candidates
        self.steps = HeadSteps(head, vocab_size)  # its K steps (as programs where the target's rounds are)

    def forget(self, key: Hashable) -> None:
        self.last.pop(key, None)
        self.counts.pop(key, None)

    def _counts(self, key: Hashable) -> tuple[list[float], list[float]]:
        """The row's tested and accepted tokens by draft position, the prior counting as PRIOR_WEIGHT of each."""
        if key not in self.counts:
            tested = [self.PRIOR_WEIGHT] * MAX_NUM_DRAFT_TOKENS
            self.counts[key] = (tested, [self.PRIOR_WEIGHT * alpha for alpha in self.prior])
        return self.counts[key]

    def alpha(self, key: Hashable, depth: int) -> list[float]:
        """The estimated chance that the row's token at each draft position is accepted, given its prefix was."""
        tested, accepted = self._counts(key)
        return [accepted[k] / tested[k] for k in range(depth)]

    def learn(self, request: DraftRequest) -> None:
        """The tokens emitted since the row's last draft against its candidates: the longest match was accepted
        (a rejected token is never emitted in its place, as its residual is 0). Once per draft: propose calls it."""
        if request.key not in self.last:
            return
        length, candidates = self.last.pop(request.key)
        emitted = request.sequence_ids[length:]
        matches = [_common_prefix(candidate, emitted) for candidate in candidates]
        best = max(range(len(candidates)), key=matches.__getitem__)
        tested, accepted = self._counts(request.key)
        for k in range(min(matches[best] + 1, len(candidates[best]))):
            tested[k] += 1
            accepted[k] += k < matches[best]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        for request in requests:
            self.learn(request)
        drafts = {i: Draft([], None) for i, r in enumerate(requests) if r.hidden_state is None}
        ready = [i for i in range(len(requests)) if i not in drafts]
        groups: dict[tuple[bool, int, int], list[int]] = {}  # rows drafted together: same rule, W and K
        for i in ready:
            r = requests[i]
            groups.setdefault((r.sampling.is_greedy, r.num_candidates, r.num_draft_tokens), []).append(i)
        for (greedy, width, depth), rows in groups.items():
            drafts.update(zip(rows, self._draft([requests[i] for i in rows], greedy, width, depth), strict=True))
        seconds = time.perf_counter() - started
        for i in ready:
            self.last[requests[i].key] = (len(requests[i].sequence_ids), drafts[i].token_ids)
        return [
            replace(self.with_chances(requests[i].key, d), forward_seconds=seconds) if d.token_ids else d
            for i, d in sorted(drafts.items())
        ]

    def with_chances(self, key: Hashable, draft: Draft) -> Draft:
        """The draft with the row's chance for each of its tokens: they depend on the positions, not the tokens."""
        chances = [self.alpha(key, len(candidate)) for candidate in draft.token_ids]
        first = sum(candidate[0] for candidate in chances)
        for candidate in chances:  # W candidates' first tokens cannot together be accepted more than once
            candidate[0] /= max(1.0, first)
        return replace(draft, chances=chances)

    def _draft(self, requests: list[DraftRequest], greedy: bool, width: int, depth: int) -> list[Draft]:
        """The rows' K steps (head_steps.py: one program where the target's rounds replay graphs), the drafted ids
        read back once."""
        states = torch.stack([r.hidden_state for r in requests]).to(self.head.output_rows.dtype)  # type: ignore[misc]
        tokens = torch.tensor([r.sequence_ids[-1] for r in requests], device=states.device)  # [R]
        if greedy:
            ids = self.steps.greedy(states, tokens, min(width, len(self.head.vocabulary)), depth)
            return [Draft(row, None) for row in ids.tolist()]
        uniforms = torch.stack(  # [R, W, K]: each row's own generator, W*K draws a round
            [uniforms_from(r.generator, (width, depth), states.device) for r in requests]
        )
        temperatures = torch.tensor([r.sampling.temperature for r in requests], device=states.device)
        ids, full = self.steps.sampled(states, tokens, uniforms, temperatures)  # [R, W, K], [R, W, K, V]
        return [Draft(row, probs) for row, probs in zip(ids.tolist(), full, strict=True)]


def _common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def target_fingerprint(model: PreTrainedModel) -> str:
    """A hash of the target's weights rounded to bfloat16, so the same weights loaded in either format match."""
    digest = hashlib.blake2b(digest_size=8)
    for name, parameter in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(parameter.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def head_path(target_name: str) -> Path:
    """Where a target's head is (train-drafter writes it there): in a local model directory, beside the weights;
    else among the heads the project ships."""
    if Path(target_name).is_dir():
        return Path(target_name) / "recurrent-head.pt"
    return HEADS_DIRECTORY / f"{target_name.replace('/', '--')}.pt"


def save_head(head: RecurrentHead, path: Path, fingerprint: str, trained: dict[str, object]) -> None:
    """The head's own weights in bfloat16 with its sub-vocabulary, shape, target hash and how it was trained."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.to(torch.bfloat16) for name, tensor in head.state_dict().items() if name != "vocabulary"}
    record = dict(
        format=HEAD_FORMAT,
        target=fingerprint,
        hidden_size=head.shape.hidden_size,
        num_blocks=head.shape.num_blocks,
        layers=list(head.shape.layers),
        vocabulary=head.vocabulary.to(torch.int32),
        state=state,
        trained=trained,
    )
    partial = path.with_suffix(".partial")
    torch.save(record, partial)
    partial.replace(path)  # never a half-written head under the real name


_LOADED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[Path, float], RecurrentHead]] = (
    weakref.WeakKeyDictionary()
)


def cached_head(target: PreTrainedModel, path: Path) -> RecurrentHead:
    """load_head once per target model and file version: a fresh drafter per run must not pay for reading it."""
    version = (path, path.stat().st_mtime if path.is_file() else 0.0)
    by_file = _LOADED.setdefault(target, {})
    if version not in by_file:
        by_file.clear()
        by_file[version] = load_head(target, path)
    return by_file[version]


def load_head(target: PreTrainedModel, path: Path) -> RecurrentHead:
    """The head in `path` for this target, in the target's number format on its device (bfloat16 reads its output
    rows in a quarter of float32's time here: benchmarks/head_cost.py); a ValueError in one sentence when the file
    is missing, damaged, or made for other weights."""
    rebuild = "run `python -m specdemo train-drafter` to make one for this target"
    if not path.is_file():
        raise ValueError(f"No recurrent head at {path}: {rebuild}.")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
        made = record.get("format")
    except Exception as error:  # a truncated zip, a foreign pickle
        raise ValueError(f"The recurrent head {path} is damaged or not a head file ({error}); {rebuild}.") from error
    if isinstance(made, str) and made.startswith("specdemo-recurrent-head/") and made != HEAD_FORMAT:
        raise ValueError(
            f"The recurrent head {path} was made by another version of specdemo ({made}; this one reads "
            f"{HEAD_FORMAT}, whose heads read more of the target's layers): {rebuild}."
        )
    layers = tuple(record.get("layers", ()))
    layer_indices(target, layers)  # a head for another layer count is refused in its own sentence
    try:
        assert made == HEAD_FORMAT, f"format {made!r}"
        head = RecurrentHead(target, record["vocabulary"].long(), int(record["num_blocks"]), layers)
        head.load_state_dict({**record["state"], "vocabulary": record["vocabulary"].long()})
    except Exception as error:  # missing or misshapen tensors, a foreign record
        said = " ".join(str(error).split())[:200]  # one line
        raise ValueError(f"The recurrent head {path} is damaged or not a head file ({said}); {rebuild}.") from error
    head.trained = dict(record["trained"])
    fingerprint = target_fingerprint(target)
    if record["target"] != fingerprint:
        raise ValueError(
            f"The recurrent head {path} was trained for other target weights (hash {record['target']}, this target's "
            f"is {fingerprint}): {rebuild}."
        )
    return head.to(target.device, target.dtype).eval()
