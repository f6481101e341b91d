"""The lossless audit: planted bugs, the statistics, and the toy and model audits."""

from specdemo.audit.bugs import BUGS, verifier
from specdemo.audit.model import MODEL_BATCH_ROWS, ModelAudit, model_audit
from specdemo.audit.statistics import chi_square_pvalue, tv_distance
from specdemo.audit.toy import TOY_PRESETS, ToyAudit, parse_weights, toy_audit

__all__ = [
    "BUGS",
    "MODEL_BATCH_ROWS",
    "TOY_PRESETS",
    "ModelAudit",
    "ToyAudit",
    "chi_square_pvalue",
    "model_audit",
    "parse_weights",
    "toy_audit",
    "tv_distance",
    "verifier",
]
