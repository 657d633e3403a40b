"""Router-side cost of spec=auto per row and round: a batch of 16 rows (``--rows``),
every plan's round time measured at that load (nobody, draft and lookup at k = 1..4), each
row observing its last round and choosing its next (``GoodputPolicy.observe`` +
``choose``), averaged over the batch's rounds (``row_round_us``; ``choose_us``: its
``choose`` part, ``observe_us``: one ``observe``). This runs on the router's event loop for
every row of every round, so it is on the per-round path. Pure (no Ray, no models).
``--rows 1``: a row alone, which scores every plan itself every round and searches its
prompt lookup (``--context`` tokens, a text that repeats itself, two new ones a round).

Run it with ``PYTHONPATH`` at another checkout to time that checkout's policy:
    .venv/bin/python bench/policy_decision.py
    PYTHONPATH=/tmp/before .venv/bin/python bench/policy_decision.py
"""

from __future__ import annotations

import argparse
import json
import timeit

from specserve.api import GenerationRequest
from specserve.contract import CallInfo, ProposeOutcome, VerifyOutcome
from specserve.core.commit import CommitDecision
from specserve.engine.generator import new_state
from specserve.policy import CostModel, GoodputPolicy
from specserve.rounds import Plan, RoundOutcome

K, ROWS = 4, 16


def _outcome(plan: Plan, accepted: int, rows: int) -> RoundOutcome:
    """One row's round in a batch of ``rows`` every row of which took ``plan``."""
    drafts = list(range(plan.k))
    verify_s = 0.02 + 0.002 * rows + 0.0005 * rows * plan.k
    verdict = VerifyOutcome(accepted, 1, accepted == plan.k, batch_size=rows,
                            call=CallInfo(compute_s=verify_s), batch_tokens=rows * (1 + plan.k))
    decision = CommitDecision(10, plan.k, accepted, (*drafts[:accepted], 1),
                              accepted == plan.k, plan.k - accepted)
    return RoundOutcome(1, plan.k, ProposeOutcome(drafts, None, call=CallInfo(
        compute_s=0.001 * plan.k)), verdict, decision, decision.tokens, None, 0.001 * plan.k,
        verify_s, verify_s + 0.001 * plan.k, [], plan=plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=20000, help="calls per timing")
    ap.add_argument("--rows", type=int, default=ROWS, help="rows of the batch")
    ap.add_argument("--context", type=int, default=64, help="each row's tokens")
    args = ap.parse_args()
    n_rows = args.rows
    cost = CostModel()
    rows = [GoodputPolicy(cost, K, has_drafter=True) for _ in range(n_rows)]
    prompt = [100 + (i * 7919) % 97 for i in range(args.context)]  # repeats every 97
    states = [new_state(GenerationRequest(prompt_ids=prompt, max_tokens=1024, k=K), prompt, 4096,
                        None, ("", ""), f"r{i}") for i in range(n_rows)]
    plans = [Plan(None, 0, "goodput"), *(Plan(p, k, "goodput") for p in ("draft", "ngram")
                                          for k in range(1, K + 1))]
    for plan in plans:  # every plan measured at this load, in steady rounds
        for _ in range(40):
            for policy, st in zip(rows, states, strict=True):
                policy.observe(st, _outcome(plan, min(plan.k, 1), n_rows))
    o = _outcome(Plan("draft", 2, "goodput"), 1, n_rows)

    def batch_round() -> None:  # every row observes its last round and chooses its next
        for policy, st in zip(rows, states, strict=True):
            policy.observe(st, o)
            if len(st.committed) >= len(prompt) + 512:  # as a new request would
                del st.committed[len(prompt):]
            st.committed += [prompt[len(st.committed) % len(prompt)], 101]
            policy.choose(st)

    policy, st = rows[0], states[0]
    n = max(1, args.number // n_rows)
    row_round = min(timeit.repeat(batch_round, number=n, repeat=5)) / (n * n_rows)
    observe = min(timeit.repeat(lambda: policy.observe(st, o), number=args.number, repeat=5))
    print(json.dumps({"rows": n_rows, "measured_plans": len(getattr(cost, "measured", {})),
                      "choose_us": round(1e6 * row_round - 1e6 * observe / args.number, 1),
                      "observe_us": round(1e6 * observe / args.number, 1),
                      "row_round_us": round(1e6 * row_round, 1)}))


if __name__ == "__main__":
    main()
