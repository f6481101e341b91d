"""Runs recorded beforehand, for a visitor with no GPU quota left: a manifest of a few runs, the command that decodes
and writes them (`python -m specdemo.app.panels.recorded`), and what the step view reads back, with no model
and no GPU."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

from specdemo.app.form import RunRequest, defaults, parse_request
from specdemo.app.panels.lessons import POEM, SKY, SPELLING
from specdemo.app.serving.runs import trace_record
from specdemo.app.views.replay import check_replay
from specdemo.config import check_prompt_fits
from specdemo.core.rounds import Round
from specdemo.engine.decoding import speculative_generate
from specdemo.engine.drafting import build_drafter
from specdemo.engine.setup import load_pair
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel, Progress, chat_prompt_ids
from specdemo.models.platform import device_name, torch_build
from specdemo.models.shared import ModelCache

RECORDED_FOLDER = Path(__file__).with_name("recorded_runs")  # one file a run, data the page reads, beside the code
# float32, not `auto`: auto is bfloat16 on a CPU with native bfloat16, and only a float32 greedy run is sure to give the
# same tokens again on the machine that recorded it (tests/app/test_recorded.py decodes the greedy one again).
NUMBER_FORMAT = "float32"


@dataclass(frozen=True)
class Recording:
    """One recorded run: the prompt and the settings it changes from the form's defaults, as a lesson's are."""

    key: str  # its file is <key>.json
    title: str  # what the page's list says before the device and the date
    pair: str  # a key of specdemo.pairs.PAIRS that runs offline
    prompt: str
    settings: dict[str, Any] = field(default_factory=dict)

    def values(self) -> dict[str, Any]:
        """Every setting by name: the form's defaults, with the pair, the recordings' number format and this run's
        own. No comparison: a recording replays the speculative run, and the target alone's timing is a live run's."""
        return defaults(pair=self.pair, dtype=NUMBER_FORMAT, compare=False, **self.settings)


RECORDINGS: tuple[Recording, ...] = (
    Recording("copying", "Copying, greedy", "smollm2-135m-suffix", SPELLING, {"max_new_tokens": 64}),
    Recording(
        "free-writing",
        "Free writing, sampled at 0.7",
        "smollm2-135m-recurrent",
        POEM,
        {"temperature": 0.7, "max_new_tokens": 48},
    ),
    Recording(
        "hot-draft",
        "Hot draft: drafted at 1.5, verified at 0.7",
        "smollm2-135m-self",
        SKY,
        # 1.5 is the form's default too; named so that a new default does not change what this recording shows
        {"temperature": 0.7, "draft_temperature": 1.5, "max_new_tokens": 32},
    ),
    Recording(
        "three-candidates",
        "Three candidates per round, sampled at 0.7",
        "smollm2-135m-self",
        SKY,
        {"temperature": 0.7, "num_candidates": 3, "max_new_tokens": 32},
    ),
)
RECORDINGS_BY_KEY = {recording.key: recording for recording in RECORDINGS}


def file_name(key: str) -> str:
    return f"{key}.json"


def find_recording(key: str) -> Recording:
    if key not in RECORDINGS_BY_KEY:
        raise ValueError(f"There is no recorded run '{str(key)[:80]}': choose one of {', '.join(RECORDINGS_BY_KEY)}.")
    return RECORDINGS_BY_KEY[key]


def decode(
    request: RunRequest,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: torch.Tensor,  # [1, T] int64, the chat template applied
) -> list[Round]:
    """The run as the app decodes a run alone: a one-row BatchDecoder with the pair's drafter and the request's
    settings, its generator seeded from the request's seed (a run alone is never cut for a shared pass)."""
    drafter = build_drafter(request.pair.drafter, target, draft, request.drafter_options)
    sampling, speculative = request.sampling, request.speculative
    return list(speculative_generate(target.model, drafter, prompt_ids, sampling, speculative, target.eos_token_ids))


def record(recording: Recording, path: Path, cache: ModelCache | None = None, progress: Progress = print) -> dict:
    """Decode `recording` on this machine (the offline models, through `cache`) and write the trace the app offers for
    download to `path`, with where and when it was recorded under "recorded"; returns what it wrote."""
    request = parse_request(recording.prompt, recording.values())
    cache = cache or ModelCache(pinned=OFFLINE_DEFAULT)
    target, draft = load_pair(request.pair, cache, progress, dtype=request.dtype)
    prompt_ids = chat_prompt_ids(target, request.prompt, chat=request.chat)  # [1, T]
    check_prompt_fits(prompt_ids.shape[1], request.speculative.max_new_tokens, target.context_length)
    rounds = decode(request, target, draft, prompt_ids)
    trace = trace_record(request, target, prompt_ids[0].tolist(), rounds, baseline=None)
    trace["recorded"] = {
        "key": recording.key,
        "title": recording.title,
        "device": device_name(target.device),
        "number_format": request.dtype_reason,
        "torch": torch_build(),
        "date": date.today().isoformat(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")))
    return trace


def label(recorded: dict) -> str:
    """'Copying, greedy — recorded on CPU (2 cores) in float32, 2026-11-27'."""
    number_format = recorded["number_format"].split(" ")[0]
    return f"{recorded['title']} — recorded on {recorded['device']} in {number_format}, {recorded['date']}"


def _read(key: str, folder: Path) -> dict:
    recording = find_recording(key)
    path = folder / file_name(recording.key)
    if not path.is_file():
        raise ValueError(
            f"The run '{key}' has not been recorded here: run `python -m specdemo.app.panels.recorded --only {key}`."
        )
    return json.loads(path.read_text())


def choices(folder: Path = RECORDED_FOLDER) -> list[tuple[str, str]]:
    """The recorded runs for the page's list, (label, key) in the manifest's order; a run with no file is left out
    (tests/app/test_recorded.py checks that every one has its file)."""
    present = [recording.key for recording in RECORDINGS if (folder / file_name(recording.key)).is_file()]
    return [(label(_read(key, folder)["recorded"]), key) for key in present]


def load(key: str, folder: Path = RECORDED_FOLDER) -> dict:
    """The recorded run `key` as the downloaded trace: its "replay" checked (what the step view steps through) and
    "recorded" (device, number format, torch, date); a ValueError in one sentence for an unknown or missing run."""
    trace = _read(key, folder)
    check_replay(trace.get("replay"))
    return trace


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdemo.app.panels.recorded", description=__doc__)
    parser.add_argument("--out", type=Path, default=RECORDED_FOLDER, help="the folder (default: beside this module)")
    parser.add_argument("--only", choices=list(RECORDINGS_BY_KEY), action="append", help="record this one (repeat)")
    args = parser.parse_args(argv)
    cache = ModelCache(pinned=OFFLINE_DEFAULT)
    for recording in [find_recording(key) for key in args.only] if args.only else RECORDINGS:
        path = args.out / file_name(recording.key)
        started = time.perf_counter()
        trace = record(recording, path, cache)
        print(
            f"wrote {path} ({path.stat().st_size / 1000:.0f} kB): {len(trace['generated_token_ids'])} tokens in "
            f"{len(trace['rounds'])} rounds, {time.perf_counter() - started:.1f} s, on {trace['recorded']['device']} "
            f"in {trace['recorded']['number_format']}"
        )


if __name__ == "__main__":
    main()
