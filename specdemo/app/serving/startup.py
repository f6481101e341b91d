"""Which listed pairs this server offers, checked at startup in the main process: a pair gated without a token, too big
for the device, whose models do not load, whose draft model's tokenizer differs from the target's, or whose drafter
cannot be built for the target (a recurrent head trained on other weights) is left out, with one line in the log and a
few words in the pair list; a run that asks for it is refused in that sentence before anything loads (on the page,
before a ZeroGPU call is asked for), never in the middle of a run. On ZeroGPU every startup pair is loaded and checked,
and the packed size held against `spaces`' large-size threshold; elsewhere the pairs of the models already loaded (the
default target) are checked, and the rest keep their marks in the pair list."""

from __future__ import annotations

import sys

import torch

from specdemo.app.form import LeftOut
from specdemo.app.serving.zerogpu import PAIRS_VARIABLE
from specdemo.engine.drafting import build_drafter
from specdemo.engine.setup import pair_fits, pair_marks
from specdemo.models.loading import LoadedModel, check_same_tokenizer, gated_on_hub, gated_sentence, readable_bytes
from specdemo.models.shared import ModelCache
from specdemo.pairs import PAIRS, Pair, needs_token, pair_dtype

DRAFTER_MISMATCH = "its drafter does not match this target"  # why a pair is left out whose drafter failed to build


def check_pair(pair: Pair, cache: ModelCache, device: torch.device, dtype: torch.dtype) -> LeftOut | None:
    """Why `pair` cannot run here, or None when it can, its models loaded (those not yet held) to check it."""
    marks = pair_marks(device)[pair.key].removeprefix(" — ")
    if needs_token(pair):
        return LeftOut(marks, gated_sentence([name for name in pair.model_names if gated_on_hub(name)]))
    if not pair_fits(pair, device, dtype):
        return LeftOut(
            marks, f"'{pair.key}' does not fit here ({marks}): pick a smaller pair, or run it on a larger GPU."
        )
    try:
        models = [cache.get(name, print, device=device, dtype=dtype) for name in pair.model_names]
    except ValueError as error:
        return LeftOut("its models did not load at startup", str(error))
    return check_drafter(pair, models[0], models[-1])


def check_drafter(pair: Pair, target: LoadedModel, draft: LoadedModel) -> LeftOut | None:
    """Whether the pair's drafter works with its loaded target: a draft model's tokenizer agrees with the target's
    (`draft`; the target itself for a model-free kind), a model-free kind builds for it (a recurrent head checks the
    target's weights against the hash it was trained for, and is then kept for the runs: head_file.cached_head)."""
    if pair.uses_draft_model:
        try:
            check_same_tokenizer(target, draft)
        except ValueError as error:
            return LeftOut("its draft's tokenizer differs from the target's", str(error))
        return None
    try:
        build_drafter(pair.drafter, target)
    except ValueError as error:
        return LeftOut(DRAFTER_MISMATCH, str(error))
    return None


def logged(left_out: dict[str, LeftOut]) -> dict[str, LeftOut]:
    """`left_out`, each pair's sentence written to the log."""
    for key, found in left_out.items():
        print(f"Not offered here: {key}: {found.sentence}")
    return left_out


def held_pairs_left_out(cache: ModelCache, device: torch.device) -> dict[str, LeftOut]:
    """Off ZeroGPU: the listed pairs whose models are all held already (the default target's), checked without loading
    anything; the others keep their marks in the pair list, and are checked when a run asks for them, before they
    load."""
    left_out = {}
    for pair in PAIRS:
        if all(cache.holds(name, device=device) for name in pair.model_names):
            models = [cache.get(name, device=device) for name in pair.model_names]
            found = check_drafter(pair, models[0], models[-1])
            if found is not None:
                left_out[pair.key] = found
    return logged(left_out)


def startup_left_out(pairs: list[Pair], cache: ModelCache, device: torch.device) -> dict[str, LeftOut]:
    """On ZeroGPU: the startup pairs loaded, each in the format auto picks for it, and checked, and every other listed
    pair left out, since a call's worker runs only what was loaded before it forked; then the packed size is held
    against spaces' threshold."""
    checked = {pair.key: check_pair(pair, cache, device, pair_dtype(pair, "auto", device)) for pair in pairs}
    left_out = {key: found for key, found in checked.items() if found is not None}
    offered = tuple(pair.key for pair in pairs if pair.key not in left_out)
    for pair in PAIRS:
        if pair not in pairs:
            left_out[pair.key] = LeftOut("not loaded on this ZeroGPU Space", not_loaded(pair.key, offered))
    logged({key: found for key, found in left_out.items() if key in checked})
    warning = size_warning([pair for pair in pairs if pair.key in offered], model_sizes(cache), xlarge_threshold())
    if warning:
        print(warning)
    return left_out


def not_loaded(key: str, offered: tuple[str, ...]) -> str:
    """The refusal, on ZeroGPU, of a pair that was not loaded at startup: a call's worker cannot load it."""
    return (
        f"This ZeroGPU Space runs the pairs it loaded at startup, and '{key}' is not one of them: pick one of "
        f"{', '.join(offered)} (its operator can set {PAIRS_VARIABLE})."
    )


def model_sizes(cache: ModelCache) -> dict[str, int]:
    """The bytes of each held model's weights: what `spaces` packs at startup and moves to the GPU in every call."""
    with cache.lock:
        return {name: loaded.weights_bytes for name, loaded in cache.models.items()}


def xlarge_threshold() -> int | None:
    """The packed size past which `spaces` makes every call `xlarge` (the whole card at twice the quota) on this
    machine's card, from its table (spaces.zero.config, 0.51.3: 42 GiB on the RTX PRO 6000, none on the H200); None
    where it has none, or `spaces` is not imported (importing it on ZeroGPU patches torch: app.py does it first)."""
    table = sys.modules.get("spaces.zero.config")
    return None if table is None else table.get_config()["xlarge_threshold"]


def size_warning(pairs: list[Pair], sizes: dict[str, int], threshold: int | None) -> str | None:
    """A sentence naming the pairs to drop when the models of `pairs` (`sizes`: bytes by name) pack to more than
    `threshold`: the pairs whose own models weigh most first, never the first pair (the page's default), until the
    rest are under it; None when they are under it already."""
    if threshold is None:
        return None
    kept, dropped = list(pairs), []

    def packed(chosen: list[Pair]) -> int:
        return sum(sizes.get(name, 0) for name in {name for pair in chosen for name in pair.model_names})

    total = packed(kept)
    while packed(kept) > threshold and len(kept) > 1:
        heaviest = max(kept[1:], key=lambda pair: packed(kept) - packed([other for other in kept if other != pair]))
        kept.remove(heaviest)
        dropped.append(heaviest.key)
    if total <= threshold:
        return None
    return (
        f"The models loaded at startup pack to {readable_bytes(total)}, past the {readable_bytes(threshold)} at which "
        "spaces lends every call the whole card at twice the quota (xlarge): drop "
        f"{', '.join(dropped) or 'pairs'} from {PAIRS_VARIABLE} to stay under it."
    )
