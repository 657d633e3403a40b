"""The pure algorithm: sampling, verification, commit decision, n-gram proposal, stats.

numpy/torch only; no Ray, gRPC, Redis or OpenTelemetry imports (a test enforces it).
"""

from specserve.core.commit import CommitDecision, decide_commit, repair_plan, truncate_at_stop
from specserve.core.ngram import propose_ngram
from specserve.core.sampling import SamplingError, SamplingParams, probs_from_logits
from specserve.core.stats import AcceptanceStats
from specserve.core.verify import VerifyResult, verify_batch

__all__ = [
    "AcceptanceStats",
    "CommitDecision",
    "SamplingError",
    "SamplingParams",
    "VerifyResult",
    "decide_commit",
    "probs_from_logits",
    "propose_ngram",
    "repair_plan",
    "truncate_at_stop",
    "verify_batch",
]
