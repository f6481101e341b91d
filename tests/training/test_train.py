"""Training the recurrent head end to end on a tiny random model, in seconds."""

from __future__ import annotations

import math

import torch

from specdemo.drafters.head import RecurrentHead
from specdemo.drafters.head_file import load_head
from specdemo.models.loading import LoadedModel
from specdemo.training.data import (
    IGNORE,
    TEXTS_FORMAT,
    DataSettings,
    InverseCDFSampler,
    features_paths,
    write_chunk,
    write_features,
    write_texts,
)
from specdemo.training.fit import FitSettings, Positions, fit, read_positions, training_loss
from specdemo.training.run import train_drafter
from tests.helpers import tiny_model, word_tokenizer

VOCAB = 64
WORDS = ["<unk>", "</s>", *(f"w{i}" for i in range(VOCAB - 2))]


def tiny_target() -> LoadedModel:
    """A tiny random Llama that rarely ends its texts (EOS scores 0 against sharp others), so they are long."""
    model = tiny_model(3, vocab_size=VOCAB).float()
    with torch.no_grad():
        model.lm_head.weight[1] = 0.0
    return LoadedModel("tiny", model, word_tokenizer(WORDS), torch.device("cpu"))


def test_a_tiny_head_learns_the_targets_next_tokens_well_beyond_chance(tmp_path):
    target = tiny_target()
    data = DataSettings(num_texts=32, max_new_tokens=48, batch_size=8, temperature=0.0, seed=2)
    # seed 2: this random target's greedy texts fall into loops, which some draws of instructions make most of the
    # held-out labels one token (seed 0 did once the pool grew to 100 kinds: chance 0.64); these leave it at 0.53
    # argmax labels: this random target's distributions are flat (its top probability is 0.09 on average, within 0.05
    # of the second at most positions), where 400 steps of soft labels learn the distribution before its argmax
    settings = FitSettings(steps=400, batch_size=64, depth=3, vocabulary_size=48, held_out_texts=8, labels="argmax")
    output = tmp_path / "head.pt"
    summary = train_drafter(target, data, settings, tmp_path / "cache", output, tmp_path / "curves.png", print)
    alpha = summary["held_out_alpha"]
    # Chance: always drafting the label the target predicts most often in the held-out texts.
    head = load_head(target.model, output)
    chunks = sorted((tmp_path / "cache").glob("*/texts-*.pt"))
    labels = read_positions(chunks[-1:], head.shape.layers, 1).argmax[:, 0]
    chance = float(torch.bincount(labels[labels >= 0]).max() / (labels >= 0).sum())
    print(summary, chance)
    assert alpha[0] >= chance + 0.2, f"first-position α {alpha[0]:.2f} against chance {chance:.2f}"
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert len(head.vocabulary) == 48


def test_cache_files_of_an_older_format_other_texts_or_other_settings_are_written_again(tmp_path):
    """An interrupted or earlier run's cache is reused only where it is what this run would write: a chunk of the
    older format (texts and final states in one file), labels made from other texts, and texts written with other
    settings are each written again, and the positions read are those of a fresh cache."""
    target = tiny_target()
    data = DataSettings(num_texts=16, max_new_tokens=16, batch_size=8, temperature=0.0)
    layers = (1, 2)

    def positions(cache):
        paths = write_texts(target, data, cache)
        write_features(target, paths, layers)
        return paths, read_positions(paths, layers, 2)

    paths, fresh = positions(tmp_path / "fresh")
    expected = []  # each text's states from its last prompt token to its second-to-last token, layer by layer
    for path in paths:
        texts, files = torch.load(path, weights_only=True), features_paths(path, layers)
        states = [torch.load(files[f"layer {layer}"], weights_only=True)["hidden"] for layer in layers]
        for b, (start, tokens) in enumerate(zip(texts["prompt_lengths"], texts["token_ids"], strict=True)):
            expected += [torch.cat([state[b][start - 1 : len(tokens) - 1] for state in states], dim=-1)]
    assert torch.equal(fresh.hidden, torch.cat(expected))
    cache = tmp_path / "cache"
    positions(cache)
    old = torch.load(paths[0], weights_only=True)
    old_chunk = {"prompt_lengths": old["prompt_lengths"], "token_ids": old["token_ids"][::-1],
                 "hidden": [torch.zeros(len(t), 32) for t in old["token_ids"]]}  # fmt: skip
    torch.save(old_chunk, cache / paths[0].name)
    labels = features_paths(cache / paths[1].name, layers)["labels"]
    record = torch.load(labels, weights_only=True)
    record["labels"]["argmax"] = [torch.zeros_like(argmax) for argmax in record["labels"]["argmax"]]
    torch.save(record | {"source": "other texts"}, labels)
    _, again = positions(cache)
    assert torch.load(cache / paths[0].name, weights_only=True)["format"] == TEXTS_FORMAT
    for name in ("hidden", "inputs", "argmax", "follows"):
        assert torch.equal(getattr(again, name), getattr(fresh, name)), name
    data = DataSettings(num_texts=16, max_new_tokens=24, batch_size=8, temperature=0.0)
    _, longer = positions(cache)
    assert len(longer.inputs) > len(fresh.inputs)


def test_the_features_recorded_while_writing_are_those_a_teacher_forced_pass_reads(tmp_path):
    """write_chunk keeps the states and labels generate computes as it writes; write_features computes them again by
    teacher forcing over the written texts. In float64 the two agree: the states at 0..T-2, the labels at P..T-1, and
    no label after an EOS. Texts cut at the cap and texts ended by an EOS are among them; so is a chunk whose every
    text ends before the cap, where generate never reads the last EOS."""
    model = tiny_model(3, vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight[1] = 0.0  # EOS scores 0 against sharp others: a few texts end
    ending = tiny_model(3, vocab_size=VOCAB)
    with torch.no_grad():
        ending.lm_head.weight[1] = ending.lm_head.weight[2:].sum(dim=0)  # EOS comes soon in every greedy text
    for name, target_model, temperature in (("some end", model, 1.0), ("all end", ending, 0.0)):
        target = LoadedModel("tiny", target_model, word_tokenizer(WORDS), torch.device("cpu"))
        written, forced = tmp_path / name / "written" / "texts-0000.pt", tmp_path / name / "forced" / "texts-0000.pt"
        written.parent.mkdir(parents=True)
        forced.parent.mkdir(parents=True)
        settings = DataSettings(num_texts=16, max_new_tokens=24, batch_size=16, temperature=temperature)
        write_chunk(target, [f"Say {word}." for word in WORDS[:16]], settings, written, seed=1, layers=(1, 2))
        forced.write_bytes(written.read_bytes())
        write_features(target, [forced], (1, 2))
        texts = torch.load(written, weights_only=True)
        lengths = [
            len(tokens) - start for tokens, start in zip(texts["token_ids"], texts["prompt_lengths"], strict=True)
        ]
        ended = [int(tokens[-1]) == 1 for tokens in texts["token_ids"]]
        if name == "some end":
            assert 0 < sum(ended) < len(ended) and max(lengths) == settings.max_new_tokens, (lengths, ended)
        else:
            assert all(ended) and max(lengths) < settings.max_new_tokens, (lengths, ended)
        files = [features_paths(path, (1, 2)) for path in (written, forced)]
        for layer in (1, 2):
            states = [torch.load(f[f"layer {layer}"], weights_only=True)["hidden"] for f in files]
            for b, tokens in enumerate(texts["token_ids"]):
                assert states[0][b].shape == (len(tokens) - 1, 32), (name, layer, b)
                assert torch.allclose(states[0][b].double(), states[1][b].double(), rtol=1e-2, atol=1e-2)
        labels = [torch.load(f["labels"], weights_only=True)["labels"] for f in files]
        for b, length in enumerate(lengths):
            argmax = labels[0]["argmax"][b]
            assert torch.equal(argmax, labels[1]["argmax"][b]) and len(argmax) == length, (name, b)
            assert (argmax == IGNORE).tolist() == [ended[b] and i == length - 1 for i in range(length)], (name, b)
            assert torch.equal(labels[0]["top_ids"][b], labels[1]["top_ids"][b]), (name, b)
            assert torch.allclose(labels[0]["top_probs"][b].float(), labels[1]["top_probs"][b].float(), atol=1e-3)


def test_the_texts_are_sampled_from_the_targets_distribution_at_their_temperature():
    """InverseCDFSampler draws from softmax(scores / T) by the inverse of the cumulative distribution: over 200,000
    draws each token's frequency is within 5 standard errors of its probability, and one of probability 0 is never
    drawn."""
    torch.manual_seed(0)
    scores = torch.tensor([2.0, -math.inf, 0.5, 1.5, -1.0, -math.inf, 0.0, 3.0])
    n, temperature = 200_000, 0.7
    kept = InverseCDFSampler(temperature)(None, scores.expand(n, -1).contiguous())  # [n, V]: one finite score a row
    assert ((kept == 0).sum(dim=-1) == 1).all() and (kept[kept != 0] == -math.inf).all()
    frequency = torch.bincount(kept.argmax(dim=-1), minlength=len(scores)).double() / n
    probability = (scores.double() / temperature).softmax(dim=-1)
    error = (probability * (1 - probability) / n).sqrt()
    assert ((frequency - probability).abs() <= 5 * error + 1e-12).all(), (frequency, probability)
    assert (frequency[probability == 0] == 0).all()


def test_training_as_it_drafts_reads_its_own_drafts_and_trains_only_positions_drafting_reaches():
    """own_drafts: step k reads the head's own argmax of step k-1, not the text's token. The drafts loss trains a
    position only where the drafts before it were the target's argmax and the text went on with them: changing the
    label of a position after a wrong draft changes nothing, where teacher forcing's loss changes."""
    target = tiny_target()
    head = RecurrentHead(target.model, torch.arange(VOCAB), layers=(1, -1)).float()
    generator = torch.Generator().manual_seed(0)
    n, depth = 64, 3
    states = torch.randn(n, 2 * target.model.config.hidden_size, generator=generator)
    inputs = torch.randint(2, VOCAB, (n, depth), generator=generator)
    with torch.no_grad():
        logits = head(states, inputs, own_drafts=True)
        fused, rnn, token = head.read(states), torch.zeros(n, head.shape.hidden_size), inputs[:, 0]
        for k in range(depth):
            rnn, step = head.rnn_drafter(fused, rnn, token)
            assert torch.allclose(logits[:, k], step), k
            token = head.vocabulary[step.argmax(dim=-1)]
        assert not torch.allclose(head(states, inputs), logits), "teacher forcing read the same tokens"
    drafts = head.vocabulary[logits.argmax(dim=-1)]  # [n, K]
    argmax = drafts.clone()
    argmax[: n // 2, 0] = (drafts[: n // 2, 0] + 1) % VOCAB  # the first half's first draft is wrong
    batch = dict(hidden=states, inputs=inputs, argmax=argmax, follows=torch.ones(n, depth, dtype=torch.bool),
                 top_probs=torch.ones(n, depth, 8), top_ids=torch.zeros(n, depth, 8, dtype=torch.long))  # fmt: skip
    lookup = torch.arange(VOCAB)
    changed = dict(batch, argmax=argmax.clone())
    changed["argmax"][: n // 2, 1:] = (argmax[: n // 2, 1:] + 1) % VOCAB  # labels drafting never reaches
    with torch.no_grad():
        for unroll, same in (("drafts", True), ("teacher", False)):
            settings = FitSettings(unroll=unroll, depth=depth, labels="argmax")
            before, after = training_loss(head, batch, lookup, settings), training_loss(head, changed, lookup, settings)
            assert torch.isclose(before, after) == same, unroll


def test_a_checkpoint_of_other_texts_is_not_resumed(tmp_path):
    """fit resumes a checkpoint only when it was made from the same texts (made_from), not merely the same settings:
    a finished run on other texts would otherwise be handed back as this one's head."""
    target = tiny_target().model
    hidden = target.config.hidden_size

    def positions(seed: int) -> Positions:
        generator = torch.Generator().manual_seed(seed)
        argmax = torch.randint(2, VOCAB, (256, 2), generator=generator)
        return Positions(hidden=torch.randn(256, hidden, generator=generator).bfloat16(),
                         inputs=torch.randint(2, VOCAB, (256, 2), generator=generator), argmax=argmax,
                         follows=torch.ones(256, 2, dtype=torch.bool), top_probs=torch.ones(256, 2, 8).half(),
                         top_ids=argmax[..., None].expand(-1, -1, 8).clone())  # fmt: skip

    settings = FitSettings(steps=8, batch_size=32, depth=2, vocabulary_size=VOCAB, layers=(-1,))
    first, other = positions(0), positions(1)
    fit(target, first, first, settings, tmp_path / "checkpoint.pt", evaluate_every=4, made_from="first texts")
    resumed, _ = fit(target, other, other, settings, tmp_path / "checkpoint.pt", evaluate_every=4,
                     made_from="other texts")  # fmt: skip
    fresh, _ = fit(target, other, other, settings, tmp_path / "fresh.pt", evaluate_every=4, made_from="other texts")
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_texts_from_another_instruction_pool_are_written_again(tmp_path, monkeypatch):
    """The package's instructions are part of what a chunk of texts was written with: after the pool changes (more
    kinds of request), a cache of the old pool's texts is rewritten, never read as the new pool's."""
    target = tiny_target()
    data = DataSettings(num_texts=16, max_new_tokens=16, batch_size=8, temperature=0.0)
    before = [torch.load(path, weights_only=True)["source"] for path in write_texts(target, data, tmp_path)]
    monkeypatch.setattr("specdemo.training.data.pool_digest", lambda: "another pool")
    after = [torch.load(path, weights_only=True)["source"] for path in write_texts(target, data, tmp_path)]
    assert all("another pool" in source and source not in before for source in after), after


class FixedLogits:
    """A stand-in head whose logits are given: training_loss reads only its call and its vocabulary."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.vocabulary = logits, torch.arange(logits.shape[-1])

    def __call__(self, hidden, inputs, own_drafts=False):
        return self.logits


def test_soft_labels_are_the_targets_top_entries_where_the_head_can_draft_them():
    """Soft labels: the cross-entropy of the head's q against the target's top entries, weighted by their
    probabilities, over the entries in the head's sub-vocabulary and the positions inside the text, normalised by
    the weight that counted; checked against a loop over every entry."""
    generator = torch.Generator().manual_seed(0)
    n, depth, size, entries = 6, 3, 10, 8
    logits = torch.randn(n, depth, size, generator=generator)
    top_ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:entries] for _ in range(n * depth)])
    top_probs = torch.rand(n * depth, entries, generator=generator).softmax(dim=-1)
    argmax = top_ids[:, 0].clone().view(n, depth)
    argmax[0, 2] = argmax[3, 1:] = -100  # past the text's end
    lookup = torch.full((VOCAB,), -100)
    lookup[torch.arange(size) * 5] = torch.arange(size)  # the sub-vocabulary: every fifth target id
    batch = dict(
        argmax=argmax,
        top_ids=top_ids.view(n, depth, entries),
        hidden=torch.zeros(n, 4),
        top_probs=top_probs.view(n, depth, entries).half(),
        inputs=torch.zeros(n, depth, dtype=torch.long),
    )
    loss = training_loss(FixedLogits(logits), batch, lookup, FitSettings(labels="soft", depth=depth))
    total, weight = 0.0, 0.0
    for b in range(n):
        for k in range(depth):
            if argmax[b, k] < 0:
                continue
            log_q = logits[b, k].log_softmax(dim=-1)
            for a in range(entries):
                token, p = int(batch["top_ids"][b, k, a]), float(batch["top_probs"][b, k, a])
                if lookup[token] >= 0:
                    total, weight = total - p * float(log_q[lookup[token]]), weight + p
    assert weight > 0 and math.isclose(float(loss), total / weight, rel_tol=1e-5), (float(loss), total / weight)
