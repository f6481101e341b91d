"""Requests the target writes itself (Magpie), and texts answering them: on a tiny random model with a chat template."""

from __future__ import annotations

import pytest
import torch

from specdemo.models.loading import LoadedModel, chat_prompt_ids
from specdemo.training import requests
from specdemo.training.data import TARGET_REQUESTS, DataSettings, write_texts
from specdemo.training.instructions import instructions
from specdemo.training.requests import user_turn_prefix, written_requests
from tests.helpers import tiny_model, word_tokenizer

VOCAB = 64
WORDS = ["<unk>", "</s>", *(f"w{i}" for i in range(VOCAB - 2))]
TEMPLATE = (  # a user turn is "w0 w1 {content} </s>"; an answer begins with "w2"
    "{% for message in messages %}w0 w1 {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}w2 {% endif %}"
)


@pytest.fixture(autouse=True)
def short_requests(monkeypatch):
    """Requests of at most 32 tokens: seconds, not a minute, on two cores."""
    monkeypatch.setattr(requests, "REQUEST_TOKENS", 32)


def chat_target(template: str | None = TEMPLATE) -> LoadedModel:
    """A tiny random Llama whose EOS is as likely as any word, so most of its requests end within the limit."""
    tokenizer = word_tokenizer(WORDS)
    tokenizer.chat_template = template
    return LoadedModel("tiny", tiny_model(5, vocab_size=VOCAB).float(), tokenizer, torch.device("cpu"))


def test_the_user_turn_prefix_is_the_templates_text_before_a_users_message():
    assert user_turn_prefix(chat_target()) == "w0 w1 "
    with pytest.raises(ValueError, match=r"no chat template.*--instructions package"):
        user_turn_prefix(chat_target(template=None))


def test_requests_are_what_the_target_writes_after_the_prefix_distinct_ended_and_worded(tmp_path):
    """Each request is a row the target sampled after the user-turn prefix that ended with an EOS before the limit,
    held no special token and had enough words; duplicates are dropped. Checked against the rows themselves."""
    target = chat_target()
    seen = []
    generate = target.model.generate

    def recording(**kwargs):
        output = generate(**kwargs)
        seen.append(output)
        return output

    target.model.generate = recording
    written = written_requests(target, 24, 16, 0, tmp_path / "requests.json")
    expected = []
    for output in seen:
        assert torch.equal(output[:, :2], torch.tensor([[2, 3]]).expand(len(output), -1))  # "w0 w1": the prefix
        for row in output[:, 2:].tolist():
            if 1 not in row or 0 in row[: row.index(1)] or len(row[: row.index(1)]) < requests.MIN_WORDS:
                continue
            text = " ".join(WORDS[token] for token in row[: row.index(1)])
            if text not in expected:
                expected.append(text)
    assert written == expected[:24] and len(written) == 24


def test_requests_are_kept_resumed_and_a_shorter_list_is_a_longer_ones_start(tmp_path, monkeypatch):
    target = chat_target()
    first = written_requests(target, 10, 8, 0, tmp_path / "requests.json")
    longer = written_requests(target, 30, 8, 0, tmp_path / "requests.json")  # goes on from the file
    fresh = written_requests(target, 30, 8, 0, tmp_path / "fresh.json")
    assert longer[:10] == first and longer == fresh and len(set(longer)) == 30
    monkeypatch.setattr(requests, "write_batch", lambda *args, **kwargs: pytest.fail("the file holds them"))
    assert written_requests(target, 30, 8, 0, tmp_path / "requests.json") == longer
    monkeypatch.setattr(requests, "write_batch", lambda *args, **kwargs: [])  # other settings: written again
    with pytest.raises(ValueError, match="wrote 0 usable requests in 8 batches, short of 10: ask for fewer --texts"):
        written_requests(target, 10, 16, 0, tmp_path / "requests.json")


def test_both_answers_the_package_and_the_target_half_each_held_out_chunks_last(tmp_path):
    """Half the texts answer the package's instructions, half the target's own requests, their chunks interleaved;
    the target's texts are the answers to the requests in the file, in order."""
    target = chat_target()
    data = DataSettings(num_texts=32, max_new_tokens=16, batch_size=8, temperature=0.0, instructions="both")
    paths = write_texts(target, data, tmp_path)
    assert [path.parent.name for path in paths] == [tmp_path.name, TARGET_REQUESTS] * 2
    asked = {"package": instructions(16, 0), "target": written_requests(target, 16, 8, 0, tmp_path / TARGET_REQUESTS
                                                                        / "requests.json")}  # fmt: skip
    for index, path in enumerate(paths):
        chunk = torch.load(path, weights_only=True)
        texts = asked["package" if path.parent == tmp_path else "target"][8 * (index // 2) : 8 * (index // 2 + 1)]
        for text, tokens, length in zip(texts, chunk["token_ids"], chunk["prompt_lengths"], strict=True):
            assert torch.equal(tokens[:length], chat_prompt_ids(target, text)[0].to(torch.int32))
