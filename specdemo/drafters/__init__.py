"""Drafters: the protocol every drafter follows, the registry of kinds, and one module per kind."""

from specdemo.drafters.base import Draft, Drafter, DrafterKind, DraftingContext, DraftRequest, NoDrafter
from specdemo.drafters.head import RecurrentHead
from specdemo.drafters.head_file import load_head
from specdemo.drafters.hybrid import HybridDrafter
from specdemo.drafters.model import ModelDrafter
from specdemo.drafters.ngram import NgramDrafter, NgramOptions, find_ngram_continuations
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.drafters.registry import DRAFTER_KINDS, drafter_options, is_model_free
from specdemo.drafters.suffix import SuffixDrafter, SuffixOptions

__all__ = [
    "DRAFTER_KINDS",
    "Draft",
    "DraftRequest",
    "Drafter",
    "DrafterKind",
    "DraftingContext",
    "HybridDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "NgramOptions",
    "NoDrafter",
    "RecurrentDrafter",
    "RecurrentHead",
    "SuffixDrafter",
    "SuffixOptions",
    "drafter_options",
    "find_ngram_continuations",
    "is_model_free",
    "load_head",
]
