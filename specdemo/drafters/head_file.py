"""A recurrent head's file: its weights in bfloat16, sub-vocabulary, shape and training record, bound to the target's
weights by a hash; where each target's head is, and one load per target and file version."""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdemo.drafters.head import RecurrentHead, layer_indices
from specdemo.models.graphs import DEVICE_WORK

HEAD_FORMAT = "specdemo-recurrent-head/2"  # /2: reads `layers`; /1 read the final state alone
HEADS_DIRECTORY = Path(__file__).parent / "heads"  # the heads the project ships, one per offline target


def target_fingerprint(model: PreTrainedModel) -> str:
    """A hash of the target's weights rounded to bfloat16, so the same weights loaded in either format match."""
    digest = hashlib.blake2b(digest_size=8)
    for name, parameter in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(parameter.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def head_path(target_name: str) -> Path:
    """Where a target's head is (train-drafter writes it there): in a local model directory, beside the weights;
    else among the heads the project ships."""
    if Path(target_name).is_dir():
        return Path(target_name) / "recurrent-head.pt"
    return HEADS_DIRECTORY / f"{target_name.replace('/', '--')}.pt"


def save_head(head: RecurrentHead, path: Path, fingerprint: str, trained: dict[str, object]) -> None:
    """The head's own weights in bfloat16 with its sub-vocabulary, shape, target hash and how it was trained."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.to(torch.bfloat16) for name, tensor in head.state_dict().items() if name != "vocabulary"}
    record = dict(
        format=HEAD_FORMAT,
        target=fingerprint,
        hidden_size=head.shape.hidden_size,
        num_blocks=head.shape.num_blocks,
        layers=list(head.shape.layers),
        vocabulary=head.vocabulary.to(torch.int32),
        state=state,
        trained=trained,
    )
    partial = path.with_suffix(".partial")
    torch.save(record, partial)
    partial.replace(path)  # never a half-written head under the real name


_LOADED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[Path, float], RecurrentHead]] = (
    weakref.WeakKeyDictionary()
)


def cached_head(target: PreTrainedModel, path: Path) -> RecurrentHead:
    """load_head once per target model and file version: a fresh drafter per run must not pay for reading it."""
    version = (path, path.stat().st_mtime if path.is_file() else 0.0)
    by_file = _LOADED.setdefault(target, {})
    if version not in by_file:
        by_file.clear()
        by_file[version] = load_head(target, path)
    return by_file[version]


def load_head(target: PreTrainedModel, path: Path) -> RecurrentHead:
    """The head in `path` for this target, in the target's number format on its device (bfloat16 reads its output
    rows in a quarter of float32's time here: benchmarks/head_cost.py); a ValueError in one sentence when the file
    is missing, damaged, or made for other weights."""
    rebuild = "run `python -m specdemo train-drafter` to make one for this target"
    if not path.is_file():
        raise ValueError(f"No recurrent head at {path}: {rebuild}.")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
        made = record.get("format")
    except Exception as error:  # a truncated zip, a foreign pickle
        raise ValueError(f"The recurrent head {path} is damaged or not a head file ({error}); {rebuild}.") from error
    if isinstance(made, str) and made.startswith("specdemo-recurrent-head/") and made != HEAD_FORMAT:
        raise ValueError(
            f"The recurrent head {path} was made by another version of specdemo ({made}; this one reads "
            f"{HEAD_FORMAT}, whose heads read more of the target's layers): {rebuild}."
        )
    layers = tuple(record.get("layers", ()))
    layer_indices(target, layers)  # a head for another layer count is refused in its own sentence
    try:
        assert made == HEAD_FORMAT, f"format {made!r}"
        head = RecurrentHead(target, record["vocabulary"].long(), int(record["num_blocks"]), layers)
        head.load_state_dict({**record["state"], "vocabulary": record["vocabulary"].long()})
    except Exception as error:  # missing or misshapen tensors, a foreign record
        said = " ".join(str(error).split())[:200]  # one line
        raise ValueError(f"The recurrent head {path} is damaged or not a head file ({said}); {rebuild}.") from error
    head.trained = dict(record["trained"])
    with DEVICE_WORK:  # the target's weights read back and the head moved: never beside another thread's capture
        fingerprint = target_fingerprint(target)
        if record["target"] == fingerprint:
            return head.to(target.device, target.dtype).eval()
    raise ValueError(
        f"The recurrent head {path} was trained for other target weights (hash {record['target']}, this target's "
        f"is {fingerprint}): {rebuild}."
    )
