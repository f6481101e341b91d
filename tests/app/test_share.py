"""A run as a link: the query's settings are checked one by one as /generate checks them, a bad or unknown one is
left out with a sentence, and only a cheap offline run re-runs by itself."""

from __future__ import annotations

from specdemo.app.serving.share import form_from_query, link_js, runs_on_open


def test_a_links_settings_come_back_as_the_form_holds_them():
    query = {"prompt": "Hi there", "pair": "smollm2-135m-self", "temperature": "0.7", "seed": "3", "compare": "false"}
    prompt, values, notes = form_from_query({**query, "__theme": "dark", "run": "1", "view": "present"})
    assert prompt == "Hi there" and notes == []
    assert values == {"pair": "smollm2-135m-self", "temperature": 0.7, "seed": 3.0, "compare": False}
    assert runs_on_open({**query, "run": "1"}, prompt, values)
    assert not runs_on_open(query, prompt, values)  # not asked to
    assert not runs_on_open({"run": "1"}, None, values)  # nothing to decode
    assert not runs_on_open({"run": "1"}, prompt, {**values, "max_new_tokens": 512})  # not cheap


def test_a_bad_or_unknown_parameter_is_left_out_with_a_sentence_and_the_rest_kept():
    prompt, values, notes = form_from_query(
        {
            "temperature": "-1",
            "seed": "abc",
            "colour": "red",
            "compare": "maybe",
            "pair": "nope",
            "top_k": "5",
            "prompt": "",
        }
    )
    assert prompt is None and values == {"top_k": 5.0}
    text = " ".join(notes)
    assert "Left out temperature='-1': temperature must be" in text
    assert "Left out seed='abc'" in text and "Left out 'colour': the page has no such setting." in text
    assert "compare must be one of" in text and "Left out pair='nope'" in text and "The prompt is empty" in text
    assert len(notes) == 6


def test_the_copy_link_script_names_every_setting_in_the_forms_order():
    script = link_js()
    assert '"prompt", "pair", ' in script and "query.set('run', '1')" in script and "navigator.clipboard" in script


def test_a_links_rule_comes_back_and_a_bad_one_is_left_out_with_a_sentence():
    _, values, notes = form_from_query({"prompt": "Hi", "rule": "coupled", "temperature": "0.7"})
    assert values == {"rule": "coupled", "temperature": 0.7} and notes == []
    assert '"rule"' in link_js()
    _, values, notes = form_from_query({"rule": "shuffled"})
    assert values == {} and notes == ["Left out rule='shuffled': rule must be 'standard' or 'coupled', got 'shuffled'."]
