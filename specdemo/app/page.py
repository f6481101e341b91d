"""The page: a header, the settings column (from the one settings table) and four tabs, composed; each tab's module
holds its layout and handlers."""

from __future__ import annotations

import gradio as gr

from specdemo.app.form import RUN_FIELDS, SECTIONS, describe_pair, pair_draft_temperature
from specdemo.app.panels.lessons import LessonRow
from specdemo.app.serving.handlers import end_session
from specdemo.app.serving.runs import QUEUE_SIZE, RUN_CONCURRENCY, Server
from specdemo.app.serving.share import RACE_TAB, RERUNNING, form_from_query, race_from_query, run_note
from specdemo.app.tabs import audit, batch, one_prompt, race
from specdemo.app.views.render import LEGEND_HTML, THEME_CSS
from specdemo.engine.resources import bound_allocator_arenas, freeze_startup_objects
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR

HEADER = (
    "<h2>Speculative decoding, made visible</h2><p>A draft proposes tokens; the target checks them all in one pass "
    "and keeps each with probability min(1, p/q), resampling the first it refuses. The output follows exactly the "
    "target's own distribution: only the speed changes. Under the rule <i>same text for any drafter</i> one noise "
    f"per position picks both tokens, and the text is the target's own for its seed.</p><p>{LEGEND_HTML}</p>"
)
# Gradio's queue looks for new events every 1 ms while it has none to start, and for progress every 10 ms; each look
# takes the GIL from the engine's thread. The idle server's thread used 0.8 s of CPU in 8 s, 0.09 s at these periods.
# An event now waits up to 20 ms to start.
QUEUE_POLL_SECONDS = {"sleep_when_free": 0.02, "progress_update_sleep_when_free": 0.1}
# After a shared link set the form: press its tab's Run once the pair's own settings have landed.
RUN_ON_OPEN_JS = f"""() => {{
  if (document.querySelector('#link-note')?.innerText.includes('{RERUNNING}')) {{
    const race = new URLSearchParams(location.search).get('tab') === '{RACE_TAB}';
    setTimeout(() => document.querySelector(race ? '#race-run' : '#run')?.click(), 1500);
  }}
}}"""
# ?view=present: large tokens and no settings, for a projector. A class on <body> and rules that reach the whole page.
PRESENTER_JS = (
    "if (new URLSearchParams(location.search).get('view') === 'present') document.body.classList.add('present');"
)
# The toggle beside the lessons: the same class, and the address keeps ?view=present so a reload or a copied address
# stays in the view.
PRESENTER_TOGGLE_JS = """() => {
  const on = document.body.classList.toggle('present');
  const address = new URL(location.href);
  if (on) address.searchParams.set('view', 'present'); else address.searchParams.delete('view');
  history.replaceState(null, '', address);
  window.dispatchEvent(new Event('resize'));  // the charts take the width the hidden settings leave
}"""
PRESENTER_HEAD = """<style>
#device-line { font-size: .85em; opacity: .8; }
body.present #settings-column, body.present #limits, body.present #examples,
body.present #header p:first-of-type { display: none !important; }
body.present #tokens .tok, body.present #step-tokens .tok { font-size: 1.6em; line-height: 1.6; }
body.present #race-lanes .tok { font-size: 1.3em; line-height: 1.6; }
body.present #round-sentence { font-size: 1.4em; }
</style>"""
DELETE_CACHE = (3600, 86_400)  # Gradio's own cached files (uploads, copies) go once a day old, looked at hourly


def build_demo(
    cache: ModelCache | None = None, queue_size: int = QUEUE_SIZE, run_concurrency: int = RUN_CONCURRENCY
) -> gr.Blocks:
    """The whole page. `cache` holds loaded models across runs and users (a fresh one by default)."""
    bound_allocator_arenas()  # before the queue starts its worker threads
    server = Server.start(cache, run_concurrency=run_concurrency)
    with gr.Blocks(title="specdemo: speculative decoding, made visible", delete_cache=DELETE_CACHE) as demo:
        gr.HTML(
            HEADER,
            css_template=THEME_CSS,
            elem_id="header",
            head=PRESENTER_HEAD,
            js_on_load=PRESENTER_JS,
        )
        gr.Markdown(server.device_line, elem_id="device-line")
        link_note = gr.Markdown(elem_id="link-note", visible=False)
        with gr.Row():
            with gr.Column(scale=1, min_width=300, elem_id="settings-column"):
                settings, note, kinds = settings_column()
            with gr.Column(scale=2):
                lessons = LessonRow()
                presenter = gr.Button("Presenter view on/off", size="sm", elem_id="presenter", scale=0, min_width=160)
                with gr.Tabs() as lessons.tabs:
                    with gr.Tab("One prompt", id="one"):
                        prompt = one_prompt.build_tab(server, settings, lessons)
                    with gr.Tab("Batch", id="batch"):
                        batch.build_tab(server, settings)
                    with gr.Tab("Race", id=RACE_TAB):
                        race_prompt, race_lanes = race.build_tab(server, settings, lessons)
                    with gr.Tab("Audit: is it lossless?", id="audit"):
                        audit.build_tab(server, lessons)
        settings["pair"].change(  # queue=False: the note changes at once, even while a run holds the queue's slot
            describe_pair,
            inputs=settings["pair"],
            outputs=[note, settings["custom_target"], settings["custom_draft"], settings["draft_temperature"], *kinds],
            queue=False,
            api_visibility="private",
        )
        settings["pair"].input(  # a person's pick only: a shared link's or a lesson's own value is not overwritten
            pair_draft_temperature,
            inputs=settings["pair"],
            outputs=settings["draft_temperature"],
            queue=False,
            api_visibility="private",
        )
        presenter.click(None, js=PRESENTER_TOGGLE_JS, api_visibility="private")
        opened = demo.load(
            open_link,
            outputs=[prompt, race_prompt, race_lanes, lessons.tabs, *settings.values(), link_note],
            queue=False,
            api_visibility="private",
        )
        opened.then(None, js=RUN_ON_OPEN_JS, api_visibility="private")
        demo.unload(end_session)  # a closed tab stops its runs at once (serving/handlers.py)
    demo.queue(max_size=queue_size, default_concurrency_limit=1)  # explicit: ZeroGPU would default to 1
    calm_queue_polling(demo)
    demo.specdemo_server = server  # what the tests reach: the server's limits
    freeze_startup_objects()  # the page and the models loaded live as long as the process
    return demo


def open_link(request: gr.Request) -> list:
    """The form as a shared link sets it (?prompt=...&seed=..., a race's on its tab with its lanes), with a note on
    what it left out and whether it re-runs; a page opened without a query is left as it is. Updates: the prompt,
    the race's prompt and lanes, the tab, the settings, the note."""
    query = dict(request.query_params) if request is not None else {}
    prompt, values, notes = form_from_query(query)
    racing, lanes, race_notes = race_from_query(query, values)
    notes += race_notes
    if prompt is None and not values and not notes and not racing:
        return [gr.skip() for _ in range(len(RUN_FIELDS) + 5)]
    if (running := run_note(query, prompt, values)) is not None:
        notes.insert(0, running)
    updates = [gr.update(value=values[spec.name]) if spec.name in values else gr.skip() for spec in RUN_FIELDS]
    note = gr.update(value=" ".join(notes), visible=bool(notes))
    typed = gr.update(value=prompt) if prompt is not None else gr.skip()
    chosen = gr.update(value=lanes) if lanes is not None else gr.skip()
    tab = gr.Tabs(selected=RACE_TAB) if racing else gr.skip()
    return [gr.skip() if racing else typed, typed if racing else gr.skip(), chosen, tab, *updates, note]


def settings_column() -> tuple[dict[str, gr.components.Component], gr.Markdown, list[gr.Column]]:
    """Every setting's control, in the table's sections; the pair's note; one column per drafter kind's options."""
    settings: dict[str, gr.components.Component] = {}
    note, kinds = None, {}
    for section, title in SECTIONS.items():
        with gr.Accordion(title, open=section != "drafter") if title else gr.Group():
            for spec in RUN_FIELDS:
                if spec.section != section:
                    continue
                if spec.kind is not None:  # a kind's options sit together, shown when the pair drafts with it
                    if spec.kind not in kinds:
                        kinds[spec.kind] = gr.Column(visible=spec.kind == DEFAULT_PAIR.drafter)
                    with kinds[spec.kind]:
                        settings[spec.name] = spec.component(visible=True)
                    continue
                settings[spec.name] = spec.component()
                if spec.name == "pair":
                    note = gr.Markdown(DEFAULT_PAIR.note, elem_id="pair-note")
    return {spec.name: settings[spec.name] for spec in RUN_FIELDS}, note, [kinds[k] for k in sorted(kinds)]


def calm_queue_polling(demo: gr.Blocks) -> None:
    """Poll Gradio's queue at QUEUE_POLL_SECONDS (private attributes of gradio.queueing.Queue, which has no setting
    for them; one that Gradio renames is left alone, and tests/app/test_app.py fails)."""
    for name, seconds in QUEUE_POLL_SECONDS.items():
        if hasattr(demo._queue, name):
            setattr(demo._queue, name, seconds)
