"""The lessons' settings are settings the page accepts, and each runs what its note says it shows."""

from __future__ import annotations

import pytest

from specdemo.app.form import RUN_FIELDS, names, parse_request
from specdemo.app.panels.lessons import LESSONS, Lesson
from specdemo.app.serving.audit import AUDIT_FIELDS, NAMES, parse_audit
from specdemo.engine.race import check_lanes


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda lesson: lesson.key)
def test_each_lesson_sets_only_real_settings_and_the_page_accepts_them(lesson: Lesson):
    fields = RUN_FIELDS if lesson.tab in ("one", "race") else AUDIT_FIELDS
    assert set(lesson.settings) <= set(names(fields)), set(lesson.settings) - set(names(fields))
    values = dict(zip(names(fields), lesson.values(fields), strict=True))
    assert all(values[name] == value for name, value in lesson.settings.items())
    if lesson.tab in ("one", "race"):
        request = parse_request(lesson.prompt, values)
        assert (lesson.tab == "race") == bool(lesson.lanes)  # a race names its lanes, a run none
        if lesson.lanes:
            assert check_lanes(list(lesson.lanes), request.pair)[1:] == list(lesson.lanes)
        assert request.pair.key == lesson.settings["pair"] and not request.pair.needs_hub  # offline, as tests run
        assert request.speculative.max_new_tokens <= 64  # a lesson runs in seconds on a laptop
    else:
        assert lesson.tab == "audit" and list(values) == NAMES
        assert parse_audit(values).bug != "none"


def test_the_lessons_teach_what_the_issue_asks():
    by_key = {lesson.key: lesson for lesson in LESSONS}
    assert len(by_key) == len(LESSONS)
    assert by_key["greedy"].settings.get("temperature", 0) == 0 and by_key["greedy"].settings.get("compare", True)
    hot = by_key["hot-draft"]
    assert hot.settings["pair"] == "smollm2-135m-self" and hot.settings["temperature"] < 1.5  # the pair drafts at 1.5
    assert by_key["three-candidates"].settings["num_candidates"] == 3
    assert by_key["copying"].settings.get("temperature", 0) == 0 and "spelling" in by_key["copying"].prompt
    same_seed = by_key["same-seed"]  # a sampled run under the coupled rule, compared with the target alone
    assert same_seed.title == "Same seed, any drafter" and "same-text check" in same_seed.watch
    assert same_seed.settings["temperature"] > 0 and same_seed.settings["rule"] == "coupled"
    assert same_seed.settings.get("compare", True)


def test_the_race_lesson_races_four_drafters_greedy_on_a_grounded_prompt():
    race = next(lesson for lesson in LESSONS if lesson.key == "race")
    assert race.tab == "race" and race.title == "Race the drafters" and len(race.lanes) >= 4
    assert race.settings.get("temperature", 0) == 0 and "spelling" in race.prompt  # greedy, copying from the prompt
    assert "same text" in race.watch and "fewest target passes" in race.watch
