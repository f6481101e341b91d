"""The replay record a run leaves in its trace: stepping through it, the inspector's figures, and the one-sentence
refusals of a trace that cannot be replayed."""

from __future__ import annotations

import json
from dataclasses import asdict

import gradio as gr
import pytest
import torch

from specdemo.app.panels import step_view
from specdemo.app.views.render import TokenSpan, round_spans
from specdemo.app.views.replay import (
    REPLAY_FORMAT,
    check_replay,
    inspector_figure,
    replay_record,
    step_html,
    view_title,
)
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.drafters import ModelDrafter
from specdemo.engine.decoding import speculative_generate
from tests.helpers import TINY_VOCAB, tiny_drafter

PROMPT = [0, 5, 9, 5, 9, 12, 7, 5, 9]


def decode(ids: list[int]) -> str:
    return "".join(f" t{token}" for token in ids)


@pytest.fixture(scope="module")
def run(tiny_target, tiny_draft):
    sampling, spec = SamplingConfig(temperature=1.0, seed=5), SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40)
    drafter = ModelDrafter(tiny_draft, SamplingConfig(temperature=1.0, seed=6), TINY_VOCAB)
    rounds = list(speculative_generate(tiny_target, drafter, torch.tensor([PROMPT]), sampling, spec, frozenset()))
    return rounds, json.loads(json.dumps(replay_record(rounds, decode, PROMPT)))  # as read back from the trace file


def test_stepping_shows_the_runs_tokens_round_by_round(run):
    rounds, record = run
    assert len(record["rounds"]) == len(rounds) and record["format"] == REPLAY_FORMAT
    for upto in (1, 3, len(rounds)):
        page = step_html(record, upto)
        assert page.count('class="step-current"') == 1
        shown = [span for r in record["rounds"][:upto] for span in r["spans"] if span["kind"] != "rejected"]
        assert [span["token_id"] for span in shown] == emitted_ids(rounds[:upto])
    assert all(r["sentence"].startswith(("The draft proposed", "Nothing was drafted")) for r in record["rounds"])


def test_the_inspector_draws_p_q_the_residual_and_u_for_a_rejection(run):
    rounds, record = run
    number = next(i for i, r in enumerate(rounds) if r.next_kind == "resampled")
    position = rounds[number].num_accepted
    view = record["rounds"][number]["views"][position]
    figure = inspector_figure(view, "")
    names = [trace.name for trace in figure.data]
    assert names[:3] == ["target p", "draft q", "residual norm(max(0, p − q))"]
    assert any(name.startswith("u = ") for name in names) and any("min(1, p/q)" in name for name in names)
    assert "(drafted)" in " ".join(figure.data[0].x) and "(drawn)" in " ".join(figure.data[0].x)
    assert "rejected (u = " in view_title(view, number + 1, position)


def test_a_trace_that_cannot_be_replayed_gets_one_sentence(run, tmp_path):
    _, record = run
    assert check_replay(record) is record
    cases = {
        "not-json.json": ("{not json", "This file is not JSON"),
        "old.json": (json.dumps({"replay": {**record, "format": 0}}), "written by another version"),
        "empty.json": (json.dumps({"replay": {**record, "rounds": []}}), "has no rounds to replay"),
        "damaged.json": (json.dumps({"replay": {**record, "rounds": [{"spans": [{"x": 1}]}]}}), "are damaged"),
        "other.json": (json.dumps([1, 2]), "This file has no rounds to replay"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(gr.Error, match=message):
            step_view.from_upload(str(tmp_path / name))
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (step_view.MAX_TRACE_BYTES + 1))
    with pytest.raises(gr.Error, match="more than the 20 MB a trace may be"):
        step_view.from_upload(str(big))


def test_next_round_stops_at_the_last_with_a_sentence_and_the_inspector_names_untested_tokens(run):
    rounds, record = run
    assert step_view.next_step(None, record, None, 0)[2] == 1  # no model: the run on show is stepped
    past = step_view.next_step(None, record, None, len(rounds))
    assert "That was the last round" in past[3]
    untested = next(i for i, r in enumerate(rounds) if r.num_accepted + 1 < len(r.draft_token_ids))
    event = gr.EventData(None, {"round": untested, "position": len(rounds[untested].views)})
    assert "never tested" in step_view.inspect_token(record, event)[0]
    note, figure = step_view.inspect_token(record, gr.EventData(None, {"round": 0, "position": 0}))
    assert note.startswith("Round 1") and figure["visible"] is True


def replayed(tiny_target, tiny_draft, temperature: float, num_candidates: int) -> tuple[list, dict]:
    sampling = SamplingConfig(temperature=temperature, seed=5)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40, num_candidates=num_candidates)
    drafter = ModelDrafter(tiny_draft, SamplingConfig(temperature=1.0, seed=6), TINY_VOCAB)
    rounds = list(speculative_generate(tiny_target, drafter, torch.tensor([PROMPT]), sampling, spec, frozenset()))
    return rounds, json.loads(json.dumps(replay_record(rounds, decode, PROMPT, greedy=temperature == 0)))


def test_with_three_candidates_the_inspector_lists_each_test_of_a_position_in_the_rules_order(tiny_target, tiny_draft):
    """At each position of the path: the candidates still alive there (the path's prefix), tried in order, each
    rejected but the last, which is the path's accepted test (after a rejection the path is one of those rejected);
    each is tested against the residual of those before it."""
    rounds, record = replayed(tiny_target, tiny_draft, 1.0, 3)
    several = 0
    for round_, replay in zip(rounds, record["rounds"], strict=True):
        path = round_.draft_token_ids
        for position, view in enumerate(replay["views"]):
            if view["step"] != "test":
                assert view["tests"] == []
                continue
            tests = view["tests"]
            numbers = [test["candidate"] for test in tests]
            assert numbers == sorted(numbers) and round_.path + 1 in numbers, (numbers, round_.path)
            if view["accepted"]:
                assert numbers[-1] == round_.path + 1
            for test in tests:
                candidate = round_.candidates[test["candidate"] - 1]
                assert candidate.token_ids[:position] == path[:position]  # alive: it shares the path's prefix
            assert [test["accepted"] for test in tests] == [False] * (len(tests) - 1) + [view["accepted"]]
            if len(tests) > 1:
                several += 1
                title = view_title(view, 1, position)
                assert "Tested here, in turn: candidate" in title and "against the residual after 1 rejected" in title
    assert several > 0  # the run has positions where a candidate met the residual of another


def test_a_greedy_run_says_argmax_and_draws_no_u(tiny_target, tiny_draft):
    rounds, record = replayed(tiny_target, tiny_draft, 0.0, 1)
    number = next(i for i, r in enumerate(rounds) if r.num_accepted < len(r.draft_token_ids))
    position = rounds[number].num_accepted
    view = record["rounds"][number]["views"][position]
    assert record["greedy"] is True and "not its argmax" in record["rounds"][number]["sentence"]
    title = view_title(view, number + 1, position, greedy=True)
    assert "greedy, so" in title and "is not the target's argmax" in title and "emitted instead" in title
    names = [trace.name for trace in inspector_figure(view, "", greedy=True).data]
    assert names[:2] == ["target p", "draft q"] and not any(name.startswith("u = ") for name in names)


def coupled_replayed(tiny_target, tiny_draft, num_candidates: int) -> tuple[list, dict]:
    """A coupled run of the engine and its replay record as read back from a trace file."""
    sampling = SamplingConfig(temperature=1.0, rule="coupled", seed=3)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=16, num_candidates=num_candidates)
    drafter = tiny_drafter("model", tiny_draft, None)
    rounds = list(speculative_generate(tiny_target, drafter, torch.tensor([PROMPT]), sampling, spec, frozenset()))
    return rounds, json.loads(json.dumps(replay_record(rounds, decode, PROMPT)))


def test_a_coupled_run_survives_the_trace_and_the_inspector_shows_y_x_and_their_noise(
    tiny_target, tiny_draft, tmp_path
):
    """Read back from a trace file, each tested position keeps its CoupledChoice (y, x, their log p + G and G, the
    chances), each span its noise; the inspector names y and x with their noise, draws log p + G in place of u, and
    never a residual."""
    rounds, record = coupled_replayed(tiny_target, tiny_draft, 1)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"replay": record}))
    shown = step_view.from_upload(str(path))[0]
    assert shown == record and len(shown["rounds"]) == len(rounds)
    rejected = 0
    for number, (round_, replay) in enumerate(zip(rounds, shown["rounds"], strict=True)):
        spans = [TokenSpan(**span) for span in replay["spans"]]
        assert spans == round_spans(round_, decode, [t for r in rounds[:number] for t in r.emitted_token_ids])
        assert len(replay["views"]) == len(round_.coupled)
        for position, view in enumerate(replay["views"]):
            choice = round_.coupled[position]
            assert {key: view["coupled"][key] for key in asdict(choice)} == asdict(choice)  # y, x, G, the chances
            assert view["coupled"]["target"] == f" t{choice.target_id}"
            assert view["u"] is None and view["ratio"] is None and view["residual"] == []
            event = gr.EventData(None, {"round": number, "position": position})
            title, figure = step_view.inspect_token(shown, event)
            assert f"' t{choice.target_id}' (log p + G = {choice.target_score:.2f}, its noise G = " in title
            assert "the target's choice" in title and "u = " not in title and "residual" not in title
            names = [trace["name"] for trace in figure["value"]["data"]]
            assert not any("residual" in name or name.startswith("u = ") or "p/q" in name for name in names)
            assert any(name.startswith(f"target's choice ' t{choice.target_id}': log p + G") for name in names)
            if view["step"] == "test" and not view["accepted"]:
                rejected += 1
                assert f"the draft's has log p + G = {choice.draft_score:.2f} (its noise G = " in title
                assert any(name.startswith(f"drafted ' t{choice.draft_id}': log p + G") for name in names)
    assert rejected > 0


def test_a_coupled_positions_candidates_are_listed_with_their_log_p_plus_g(tiny_target, tiny_draft):
    _, record = coupled_replayed(tiny_target, tiny_draft, 3)
    titles = [
        view_title(view, number + 1, position)
        for number, replay in enumerate(record["rounds"])
        for position, view in enumerate(replay["views"])
        if view["tests"]
    ]
    listed = [title for title in titles if "Tested here, in turn: candidate" in title]
    assert listed and all("residual" not in title and "u = " not in title for title in titles)
    assert any("not the target's choice" in title for title in listed)
    assert any("the target's choice, accepted" in title for title in listed)
    firsts = [replay["views"][0] for replay in record["rounds"] if replay["views"][0]["step"] == "test"]
    assert firsts and {view["coupled"]["num_alive"] for view in firsts} == {3}  # the three beams' first tokens
    said = "That one of the 3 candidates tested here would match had chance "
    assert all(said in view_title(view, 1, 0) for view in firsts)
    older = {**firsts[0], "coupled": {k: v for k, v in firsts[0]["coupled"].items() if k != "num_alive"}}
    assert ". A match here had chance " in view_title(older, 1, 0)  # a record from before num_alive: one candidate


def test_a_record_written_before_the_coupled_rule_still_replays(run):
    """A standard run's record without the coupled keys (as the recorded runs were written) loads, steps and
    inspects as before."""
    rounds, record = run
    coupled_keys = {"noise", "score", "choice_id", "choice_text", "choice_score"}
    old = {
        **record,
        "rounds": [
            {
                **replay,
                "spans": [{k: v for k, v in span.items() if k not in coupled_keys} for span in replay["spans"]],
                "views": [{k: v for k, v in view.items() if k != "coupled"} for view in replay["views"]],
            }
            for replay in record["rounds"]
        ],
    }
    assert check_replay(old) is old and step_html(old, len(rounds)) == step_html(record, len(rounds))
    number = next(i for i, r in enumerate(rounds) if r.next_kind == "resampled")
    view = old["rounds"][number]["views"][rounds[number].num_accepted]
    assert "rejected (u = " in view_title(view, number + 1, rounds[number].num_accepted)
    assert "residual norm(max(0, p − q))" in [trace.name for trace in inspector_figure(view, "").data]
