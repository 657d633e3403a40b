"""One rank of a tensor-parallel verify check (tests/test_tp.py starts tp_size of these).

Usage: python tp_logits.py RANK WORLD PORT OUT. Every rank joins a gloo group, loads its
shard of the built-in target with transformers' tp_plan, runs the same two verify calls
(a prefill with drafts, then a step on the cache) and saves the logits of each call, the
outcomes and its engine stats to OUT.RANK.pt.
"""

from __future__ import annotations

import sys

import torch


def verify_calls() -> list[list]:
    from specserve.core.sampling import SamplingParams
    from specserve.engine.target import VerifyItem

    greedy = SamplingParams()
    a = list(range(5, 41))
    b = list(range(100, 117))
    first = [VerifyItem("a", len(a), 0, a, [7, 8, 9, 10], None, greedy),
             VerifyItem("b", len(b), 0, b, [11, 12], None, greedy)]
    second = [VerifyItem("a", len(a) + 3, len(a), [7, 8, 50], [60, 61, 62, 63], None, greedy),
              VerifyItem("b", len(b) + 1, len(b), [300], [301, 302, 303], None, greedy)]
    return [first, second]


def record(engine) -> list[torch.Tensor]:
    """Wrap ``engine._decide`` so each call's logits [B, K+1, V] are kept."""
    seen: list[torch.Tensor] = []
    decide = engine._decide

    def wrapped(rows, logits):
        seen.append(logits.clone())
        return decide(rows, logits)

    engine._decide = wrapped
    return seen


def main() -> None:
    torch.set_num_threads(1)
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from specserve.engine.quiet import quiet_libraries
    from specserve.models.load import resolve_model
    from target_service.tp import setup_rank

    quiet_libraries()
    engine = setup_rank(rank, world, "127.0.0.1", port, "gloo", 60.0,
                        str(resolve_model("builtin-target")), 512 << 20)
    seen = record(engine)
    outcomes = [engine.verify(items) for items in verify_calls()]
    torch.save({"logits": seen, "outcomes": [[vars(o) for o in oc] for oc in outcomes],
                "stats": engine.stats()}, f"{out}.{rank}.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
