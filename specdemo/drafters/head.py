"""The recurrent head (ReDrafter, Cheng et al. 2024): an RNN on the target's hidden states and its last token, scoring
the sub-vocabulary the target writes most (FR-Spec) through the target's tied LM head; per sequence, lifted by vmap."""

# R = rows, W = beams, K = num_draft_tokens, N = positions (training), H = the target's hidden size,
# F = the target states read (the layers read side by side: layers x H), V = the target's vocab_size,
# U = the head's sub-vocabulary size

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from specdemo.core.coupled import coupled_choice, coupled_top
from specdemo.core.sampling import sample_one


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
        self.register_buffer("vocabulary", vocabulary.long().clone())  # [U] target ids, most written first
        self.register_buffer("embedding", embedding, persistent=False)
        self.register_buffer("output_rows", output[vocabulary], persistent=False)  # [U, H]
        self.fuse = nn.Linear(len(layers) * hidden, hidden, bias=False) if len(layers) > 1 else None  # F
        self.input = nn.Linear(hidden, hidden)  # W, with a bias
        self.recurrent = nn.Linear(hidden, hidden, bias=False)  # U
        self.blocks = nn.ModuleList(nn.Linear(2 * hidden, 2 * hidden) for _ in range(num_blocks))
        self.project = nn.Linear(2 * hidden, hidden)
        self.shape = HeadShape(hidden, num_blocks, layers)
        self.trained: dict = {}  # how its file says it was trained, with its held-out figures

    def read(self, llm_states: torch.Tensor) -> torch.Tensor:  # [..., F] -> [..., H]
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
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [..., H] the next rnn_state, [..., U] logits over the sub-vocabulary
        """One step for one sequence (or any leading dimensions, as training feeds it)."""
        embedded = nn.functional.embedding(input_token, self.embedding)  # [..., H]
        rnn_state = nn.functional.silu(self.input(embedded) + self.recurrent(rnn_state))
        features = torch.cat([llm_state, rnn_state], dim=-1)  # [..., 2H]
        for block in self.blocks:
            features = features + nn.functional.silu(block(features))
        return rnn_state, self.project(features) @ self.output_rows.T

    def forward(
        self,
        llm_states: torch.Tensor,  # [N, F]
        input_tokens: torch.Tensor,  # [N, K] the token the target chose, then the K - 1 tokens that followed
        own_drafts: bool = False,  # read its own greedy drafts after the first token, as drafting does
    ) -> torch.Tensor:  # [N, K, U] logits of the K tokens after each input token (for training)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [K] target ids, [K, U] q each was drawn from
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
        llm_states: torch.Tensor,  # [R, F]
        llm_tokens: torch.Tensor,  # [R] int64
        uniforms: torch.Tensor,  # [R, W, K] float64
        temperatures: torch.Tensor,  # [R]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [R, W, K] target ids, [R, W, K, U] q
        """W i.i.d. draft sequences per row: sample_seq lifted over beams (sharing the row's state), then rows."""
        over_beams = torch.func.vmap(self.sample_seq, in_dims=(None, None, 0, None))
        return torch.func.vmap(over_beams)(self.read(llm_states), llm_tokens, uniforms, temperatures)

    def coupled_beams(
        self,
        llm_states: torch.Tensor,  # [R, F]
        llm_tokens: torch.Tensor,  # [R] int64
        noise: torch.Tensor,  # [R, K, U] float64: the coupled rule's G at each drafted position, on the sub-vocabulary
        temperatures: torch.Tensor,  # [R]
        width: int,  # W <= U
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [R, W, K] target ids, [R, W, K, U] q, [R, W] live
        """The coupled rule's W drafts: the W best first tokens of log q + G (distinct), then each beam's argmax of
        log q + G at its next positions, the noise the target's own choices use. A beam whose first token has q = 0
        (q allows fewer than W) is not live: it is returned, to keep the shape, and not drafted."""
        llm_states = self.read(llm_states)
        rnn_state, logits = self.rnn_drafter(llm_states, torch.zeros_like(llm_states), llm_tokens)
        q = (logits.float() / temperatures[:, None]).softmax(dim=-1)  # [R, U]
        chosen, live = coupled_top(q, noise[:, 0], width)  # [R, W] sub-vocabulary indices, [R, W] q > 0
        sequences, probs = [chosen], [q[:, None].expand(-1, width, -1)]
        rnn_state = rnn_state[:, None].expand(-1, width, -1)  # [R, W, H]
        states = llm_states[:, None].expand(-1, width, -1)
        for step in range(1, noise.shape[1]):
            rnn_state, logits = self.rnn_drafter(states, rnn_state, self.vocabulary[sequences[-1]])
            q = (logits.float() / temperatures[:, None, None]).softmax(dim=-1)  # [R, W, U]
            sequences.append(coupled_choice(q, noise[:, step, None]))
            probs.append(q)
        return self.vocabulary[torch.stack(sequences, dim=2)], torch.stack(probs, dim=2), live

    def beam_search(
        self,
        llm_states: torch.Tensor,  # [R, F]
        llm_tokens: torch.Tensor,  # [R] int64
        width: int,  # W <= U
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
            totals = (scores[..., None] + logits.float().log_softmax(dim=-1)).flatten(1)  # [R, W*U]
            scores, flat = totals.topk(width, dim=-1)  # [R, W]
            beams, tokens = flat // logits.shape[-1], flat % logits.shape[-1]
            sequences = torch.cat([sequences.gather(1, beams[..., None].expand_as(sequences)), tokens[..., None]], -1)
            rnn_state = rnn_state.gather(1, beams[..., None].expand_as(rnn_state))
        return self.vocabulary[sequences]
