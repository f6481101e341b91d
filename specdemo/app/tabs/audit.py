"""The Audit tab and /audit: "is it lossless?", checked live on toy distributions and on the real model, beside a
planted bug that must fail the same check; under the coupled rule, also "is each seed's text the target alone's?".
Its layout and events; its settings table, parsing and work are serving/audit.py's."""

from __future__ import annotations

from functools import partial

import gradio as gr

from specdemo.app.form import by_name, signature
from specdemo.app.panels.lessons import LessonRow
from specdemo.app.serving.audit import (
    AUDIT_FIELDS,
    DEFAULT_SAMPLES,
    LOWER_AUDIT,
    NAMES,
    audit_seconds,
    audit_steps,
    bug_choices,
    model_audit_steps,
    parse_audit,
    preset_weights,
)
from specdemo.app.serving.handlers import stoppable
from specdemo.app.serving.runs import Server, check_values
from specdemo.app.serving.zerogpu import gpu_function

INTRO = (
    "Speculative decoding claims its output follows exactly the target's distribution. Check it: **toy** mode runs "
    "the project's own sampler on distributions you choose and tests the tokens it emits against p; **model** mode "
    "draws a prompt's first tokens many times with speculative decoding and with the target alone, and compares "
    "them. A **planted bug** runs the same audit with a broken sampler, which should fail. The hot self-draft pair "
    "(SmolLM2 drafting for itself at temperature 1.5) makes the bugs visible in model mode; prompt lookup drafts "
    "one-hot, so a wrong q changes nothing there. Under the rule **same text for any drafter**, the audit also checks "
    "that each seed's speculative text is the target alone's text for that seed, and its planted bugs misuse the "
    "noise: some break the distribution, some only the sameness of the text."
)
MODEL_SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty", "num_tokens")  # model mode's row


def build_tab(server: Server, lessons: LessonRow) -> None:
    """The Audit tab, inside the page's tabs, with the lessons that audit; its passes take turns with the runs'
    passes."""
    gr.Markdown(INTRO)
    controls = {}
    with gr.Row():
        for name in ("mode", "rule", "bug"):
            controls[name] = by_name(AUDIT_FIELDS, name).component()
    with gr.Row():
        for name in ("num_samples", "seed", "num_draft_tokens", "num_candidates"):
            controls[name] = by_name(AUDIT_FIELDS, name).component()
    with gr.Group(visible=True) as toy_box:
        controls |= {spec.name: spec.component() for spec in AUDIT_FIELDS if spec.section == "toy"}
    with gr.Group(visible=False) as model_box:
        controls |= {spec.name: spec.component() for spec in AUDIT_FIELDS if spec.name in ("prompt", "pair")}
        with gr.Row():
            controls |= {name: by_name(AUDIT_FIELDS, name).component() for name in MODEL_SAMPLING}
    with gr.Row():
        run = gr.Button("Run the audit", variant="primary", elem_id="audit-run")
        stop = gr.Button("Stop", variant="stop", elem_id="audit-stop")
    verdict = gr.Markdown(elem_id="audit-verdict")
    with gr.Row():
        chart = gr.Plot(elem_id="audit-chart", show_label=False)
        tv_chart = gr.Plot(elem_id="audit-tv-chart", show_label=False)
    download = gr.DownloadButton("Download the audit (JSON)", visible=False, elem_id="audit-download")
    wire_choices(controls, toy_box, model_box)
    wire(server, [controls[name] for name in NAMES], [verdict, chart, tv_chart, download], run, stop, lessons)


def wire(server: Server, inputs: list, outputs: list, run: gr.Button, stop: gr.Button, lessons: LessonRow) -> None:
    """The checked audit (/audit), the lessons' audits and Stop, which cancels them."""
    checked = run.click(
        check_values(NAMES, parse_audit), inputs=inputs, outputs=None, preprocess=False, api_visibility="private"
    )
    model_steps = gpu_function(
        partial(model_audit_steps, server), audit_seconds, "The model audit", LOWER_AUDIT
    )  # a ZeroGPU call each
    steps = partial(audit_steps, server, model_steps)
    handler = stoppable(steps, signature([], AUDIT_FIELDS), "audit", audit_steps.__doc__)
    event = checked.success(  # /audit checks again, for API clients
        handler,
        inputs=inputs,
        outputs=outputs,
        concurrency_limit=1,
        concurrency_id="audit",
        preprocess=False,
        api_name="audit",
    )
    audits = lessons.wire(
        "audit",
        inputs,
        lambda lesson: lesson.values(AUDIT_FIELDS),
        steps,
        outputs,
        concurrency_limit=1,
        concurrency_id="audit",
    )
    stop.click(None, cancels=[event, *(ran for _, _, ran in audits)], api_visibility="private")


def wire_choices(controls: dict, toy_box: gr.Group, model_box: gr.Group) -> None:
    """The choices that change others: the mode shows its settings, the rule offers its bugs, a preset fills p and q."""
    controls["mode"].change(
        lambda chosen: (
            gr.update(visible=chosen == "toy"),
            gr.update(visible=chosen == "model"),
            DEFAULT_SAMPLES[chosen],
        ),
        inputs=controls["mode"],
        outputs=[toy_box, model_box, controls["num_samples"]],  # a toy N is out of range in model mode
        queue=False,
        api_visibility="private",
    )
    controls["preset"].change(
        preset_weights,
        inputs=controls["preset"],
        outputs=[controls["target_weights"], controls["draft_weights"]],
        queue=False,
        api_visibility="private",
    )
    controls["rule"].change(
        lambda rule: gr.update(choices=bug_choices(rule), value="none"),
        inputs=controls["rule"],
        outputs=controls["bug"],
        queue=False,
        api_visibility="private",
    )
