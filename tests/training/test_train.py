"""Training the recurrent head end to end on a tiny random model, in seconds."""

from __future__ import annotations

import torch

from specdemo.drafters.recurrent import load_head
from specdemo.models.loading import LoadedModel
from specdemo.training.data import DataSettings
from specdemo.training.fit import FitSettings, read_positions
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
    data = DataSettings(num_texts=32, max_new_tokens=48, batch_size=8, temperature=0.0)
    settings = FitSettings(steps=400, batch_size=64, depth=3, vocabulary_size=48, held_out_texts=8)
    output = tmp_path / "head.pt"
    summary = train_drafter(target, data, settings, tmp_path / "cache", output, tmp_path / "curves.png", print)
    alpha = summary["held_out_alpha"]
    # Chance: always drafting the label the target predicts most often in the held-out texts.
    chunks = sorted((tmp_path / "cache").glob("*/texts-*.pt"))
    labels = read_positions(chunks[-1:], 1).argmax[:, 0]
    chance = float(torch.bincount(labels[labels >= 0]).max() / (labels >= 0).sum())
    print(summary, chance)
    assert alpha[0] >= chance + 0.2, f"first-position α {alpha[0]:.2f} against chance {chance:.2f}"
    assert (tmp_path / "curves.png").stat().st_size > 1000
    head = load_head(target.model, output)
    assert len(head.vocabulary) == 48
