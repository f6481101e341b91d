"""The lossless audit: planted bugs, the statistics, and the toy and model audits."""

from specdemo.audit.bugs import BUGS, COUPLED_BUGS, RULE_BUGS, batch_noise, noise_for, planted_rule, verifier
from specdemo.audit.model import MODEL_BATCH_ROWS, ModelAudit, audit_draws, model_audit
from specdemo.audit.statistics import chi_square_pvalue, tv_distance
from specdemo.audit.toy import TOY_PRESETS, ToyAudit, coupled_toy_audit, parse_weights, toy_audit

__all__ = [
    "BUGS",
    "COUPLED_BUGS",
    "MODEL_BATCH_ROWS",
    "RULE_BUGS",
    "TOY_PRESETS",
    "ModelAudit",
    "ToyAudit",
    "audit_draws",
    "batch_noise",
    "chi_square_pvalue",
    "coupled_toy_audit",
    "model_audit",
    "noise_for",
    "parse_weights",
    "planted_rule",
    "toy_audit",
    "tv_distance",
    "verifier",
]
