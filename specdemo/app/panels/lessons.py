"""One-click lessons: each sets the form (or the audit's) to show one idea of speculative decoding, says what to watch,
and runs. The run is given the lesson's own settings, not read back from the form, so it never starts with a value
that had not yet reached the page; the form shows the same settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import gradio as gr

from specdemo.app.form import Field, defaults, signature
from specdemo.app.serving.handlers import stoppable

SPELLING = (
    "Correct the spelling mistakes in this text and return the corrected text:\n\nThe quartely planing meeting is "
    "moved from Tuesday to Thursday. Anna will presnt the budget review and Tom will cover the hirring plan."
)
POEM = "Write a short poem about autumn leaves falling in a quiet park."
SKY = "Explain why the sky is blue to a ten-year-old."


@dataclass(frozen=True)
class Lesson:
    """A preset: the tab it runs in, the prompt, a race's lanes and the settings it changes from the defaults, and what
    to watch."""

    key: str  # the button's id is lesson-<key>
    title: str
    watch: str
    tab: str = "one"  # "one": the One prompt tab's run; "race": the Race tab's; "audit": the Audit tab's
    prompt: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    lanes: tuple[str, ...] = ()  # a race's drafter lanes (the target alone always races)

    def values(self, fields: Sequence[Field]) -> list:
        """Every setting of `fields`, in their order, at the lesson's value or its default."""
        return list(defaults(fields, **self.settings).values())


LESSONS = [
    Lesson(
        "copying",
        "Copying",
        "The answer repeats the prompt, so the suffix drafter proposes long runs and the target accepts nearly all of "
        "them: watch the tokens per target pass in the headline and the long underlined runs.",
        prompt=SPELLING,
        settings={"pair": "smollm2-135m-suffix", "max_new_tokens": 64},
    ),
    Lesson(
        "free-writing",
        "Free writing",
        "Nothing to copy: the trained recurrent head guesses every round, and the target refuses most guesses "
        "(struck through), each followed by a token drawn from the residual. Watch α and the speedup against Copying.",
        prompt=POEM,
        settings={"pair": "smollm2-135m-recurrent", "temperature": 0.7, "max_new_tokens": 48},
    ),
    Lesson(
        "hot-draft",
        "Hot draft",
        "The same model drafts at temperature 1.5 and is verified at 0.7. A token the draft over-weights (q > p) is "
        "kept with probability p/q; after a rejection the next token comes from the residual max(0, p − q). Click a "
        "struck-through or dotted token to see p, q, the residual and u. The text still follows the target exactly.",
        prompt=SKY,
        settings={"pair": "smollm2-135m-self", "temperature": 0.7, "max_new_tokens": 32, "compare": False},
    ),
    Lesson(
        "greedy",
        "Greedy = target",
        "At temperature 0 the output must be the target's own greedy text, token for token, however often the draft "
        "is wrong: many drafts are rejected here, and the summary compares the text with the target alone's.",
        prompt=POEM,
        settings={"pair": "smollm2-135m-suffix", "max_new_tokens": 48},
    ),
    Lesson(
        "same-seed",
        "Same seed, any drafter",
        "Sampled at temperature 0.8 under the rule 'same text for any drafter': one noise per position picks the "
        "target's token and the draft's, so the text is the target's own draw for seed 0. Drafts are still refused "
        "(struck through), yet the summary's same-text check finds the text identical to the target alone's.",
        prompt=SKY,
        settings={"pair": "smollm2-135m-self", "temperature": 0.8, "rule": "coupled", "max_new_tokens": 32},
    ),
    Lesson(
        "three-candidates",
        "Three candidates",
        "The draft samples three continuations and the target checks them in one pass (the tree below). A "
        "rejected first candidate lets the next be tested against the residual, so more tokens pass per round.",
        prompt=SKY,
        settings={
            "pair": "smollm2-135m-self",
            "temperature": 0.7,
            "max_new_tokens": 24,
            "num_candidates": 3,
            "compare": False,
        },
    ),
    Lesson(
        "race",
        "Race the drafters",
        "Every drafter decodes the same prompt at once, each lane a row of one batch, greedy: the lanes write the same "
        "text token for token, and the lanes that copy from the prompt finish in the fewest target passes. The finish "
        "chart draws each lane against the shared passes and against its own estimated time alone.",
        tab="race",
        prompt=SPELLING,
        settings={"pair": "smollm2-135m-ngram", "max_new_tokens": 48},
        lanes=("ngram", "suffix", "recurrent", "hybrid"),
    ),
    Lesson(
        "broken-sampler",
        "A broken sampler",
        "This sampler draws the token after a rejection from p instead of the residual max(0, p − q). The audit runs "
        "it 200,000 times on a toy p and q and finds its tokens do not follow p; pick bug 'none' and run again to "
        "see the real rule pass.",
        tab="audit",
        settings={"bug": "resample from p"},
    ),
]


class LessonRow:
    """The row of lesson buttons (#lessons, a #lesson-<key> button each) and the line that says what to watch
    (#lesson-note). Made above the tabs; `tabs` is set once they exist, so a lesson can show its own."""

    def __init__(self) -> None:
        gr.Markdown("**Lessons**: one click sets the form and runs it.", elem_id="lessons-title")
        with gr.Row(elem_id="lessons"):
            self.buttons = {
                lesson.key: gr.Button(lesson.title, size="sm", elem_id=f"lesson-{lesson.key}", scale=0, min_width=110)
                for lesson in LESSONS
            }
        self.note = gr.Markdown(visible=False, elem_id="lesson-note")
        self.tabs: gr.Tabs | None = None

    def wire(
        self,
        tab: str,
        form: list[gr.components.Component],
        values: Callable[[Lesson], list],
        steps: Callable[..., Iterator[tuple]],
        outputs: list[gr.components.Component],
        **queueing: Any,
    ) -> list[tuple[Lesson, gr.events.Dependency, gr.events.Dependency]]:
        """Each lesson of `tab`: its button sets `form` to `values(lesson)`, says what to watch and shows the tab,
        then runs `steps(*values(lesson), run_id=...)` into `outputs` (with `queueing`: the tab's concurrency). The run
        is given the lesson's values, not the form's, so it never starts with a value that has not reached the page.
        Returns (lesson, its loading event, its run) for each."""
        wired = []
        for lesson in LESSONS:
            if lesson.tab != tab:
                continue
            loaded = self.buttons[lesson.key].click(
                lambda lesson=lesson: [*shown(lesson), *values(lesson)],
                outputs=[self.note, self.tabs, *form],
                queue=False,
                api_visibility="private",
            )
            handler = stoppable(partial(steps, *values(lesson)), signature([], []), f"lesson_{lesson.key}", None)
            ran = loaded.then(handler, outputs=outputs, api_visibility="private", **queueing)
            wired.append((lesson, loaded, ran))
        return wired


def shown(lesson: Lesson) -> list:
    """What a lesson's click shows besides its settings: what to watch, and its tab (fresh updates each call)."""
    return [gr.update(value=f"**{lesson.title}.** {lesson.watch}", visible=True), gr.Tabs(selected=lesson.tab)]
