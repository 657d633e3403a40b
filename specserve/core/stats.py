"""Acceptance statistics, the pure layer under the Prometheus metrics (vLLM's scheme).

    acceptance rate         = accepted_tokens / draft_tokens
    mean acceptance length  = 1 + accepted_tokens / drafts    (counts the bonus/recovered)

PromQL over the exported counters (``specserve/service/metrics.py``; Ray prefixes every
application metric with ``ray_``):
    sum(rate(ray_specserve_spec_decode_num_accepted_tokens_total[5m]))
      / sum(rate(ray_specserve_spec_decode_num_draft_tokens_total[5m]))
    1 + sum(rate(ray_specserve_spec_decode_num_accepted_tokens_total[5m]))
      / sum(rate(ray_specserve_spec_decode_num_drafts_total[5m]))
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    rounds: int = 0  # verify rounds, including k = 0 (plain) rounds
    drafts: int = 0  # rounds that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens committed (accepted + recovered + bonus)
    bonus_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def observe(self, k: int, n: int, emitted: int, bonus: bool) -> None:
        if not 0 <= n <= k:
            raise ValueError(f"accepted {n} outside [0, {k}]")
        self.rounds += 1
        self.emitted_tokens += emitted
        if k == 0:
            return
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += n
        self.bonus_tokens += int(bonus)
        for lst, m in ((self.drafted_per_position, k), (self.accepted_per_position, n)):
            if len(lst) < m:
                lst.extend([0] * (m - len(lst)))
            for i in range(m):
                lst[i] += 1

    def merge(self, other: AcceptanceStats) -> None:
        for name in ("rounds", "drafts", "draft_tokens", "accepted_tokens", "emitted_tokens",
                     "bonus_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, c in enumerate(theirs):
                mine[i] += c

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted_tokens / self.rounds if self.rounds else 0.0

    def per_position_rate(self) -> list[float]:
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens,
            "bonus_tokens": self.bonus_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
        }
