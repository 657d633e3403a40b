"""The commit decision and cache repair arithmetic.

Cache convention (both drafter and target): a cache holds the keys/values of every
committed token *except the last one*, which is the first input of the next round. After a
round that drafted k tokens and accepted n, the target's cache is cropped to
``committed_len_before + n`` (it had fed the last committed token and all k drafts), the
drafter's to the same length (it may lack the last accepted draft, which it then feeds next
round). ``repair_plan`` turns (what a cache holds, what is committed) into (keep, feed):
one rule for normal rounds, retries, evictions and restarts alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CommitDecision:
    committed_len_before: int
    num_drafted: int  # k
    num_accepted: int  # n, accepted drafts
    tokens: tuple[int, ...]  # accepted drafts + the recovered or bonus token (n + 1 tokens)
    bonus: bool  # True: the extra token is a bonus token (all k passed); else recovered
    rolled_back: int  # k - n drafts discarded

    @property
    def committed_len(self) -> int:
        return self.committed_len_before + len(self.tokens)


def decide_commit(
    committed_len: int, draft_tokens: Sequence[int], num_accepted: int, extra_token: int
) -> CommitDecision:
    k = len(draft_tokens)
    if not 0 <= num_accepted <= k:
        raise ValueError(f"num_accepted={num_accepted} outside [0, {k}]")
    return CommitDecision(
        committed_len_before=committed_len,
        num_drafted=k,
        num_accepted=num_accepted,
        tokens=(*draft_tokens[:num_accepted], int(extra_token)),
        bonus=num_accepted == k,
        rolled_back=k - num_accepted,
    )


def truncate_at_stop(
    tokens: Sequence[int], remaining: int, eos_token_id: int | None
) -> tuple[tuple[int, ...], str | None]:
    """Cut a round's committed tokens at EOS (kept) or at the token budget.

    Returns (tokens to emit, finish reason or None). Tokens after a stop are never emitted.
    """
    out: list[int] = []
    for t in tokens:
        if len(out) >= remaining:
            return tuple(out), "length"
        out.append(int(t))
        if eos_token_id is not None and t == eos_token_id:
            return tuple(out), "stop"
    if len(out) >= remaining:
        return tuple(out), "length"
    return tuple(out), None


@dataclass(frozen=True)
class RepairPlan:
    keep: int  # cache entries to keep (crop to this length)
    feed_from: int  # feed committed[feed_from:] before drafting / verifying


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the common case, at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def repair_plan(cached: Sequence[int], committed: Sequence[int]) -> RepairPlan:
    """Keep the longest prefix of the cache that agrees with the committed tokens, but at
    most ``len(committed) - 1`` entries (the last committed token is always fed)."""
    if not committed:
        raise ValueError("committed token list is empty")
    keep = min(common_prefix_len(cached, committed), len(committed) - 1)
    return RepairPlan(keep=keep, feed_from=keep)


def check_tokens_window(
    session_id: str, committed_len: int, tokens_start: int, tokens: Sequence[int]
) -> None:
    """Argument checks of the services' ``tokens_start`` protocol: a call sends
    ``tokens = committed[tokens_start:committed_len]`` and the session supplies the prefix."""
    if committed_len < 1:
        raise ValueError(
            f"session {session_id!r}: committed_len must be >= 1, got {committed_len}")
    if not 0 <= tokens_start <= committed_len:
        raise ValueError(
            f"session {session_id!r}: tokens_start={tokens_start} must be in "
            f"[0, committed_len={committed_len}]")
    if len(tokens) != committed_len - tokens_start:
        raise ValueError(
            f"session {session_id!r}: len(tokens)={len(tokens)} must equal committed_len - "
            f"tokens_start = {committed_len} - {tokens_start} = {committed_len - tokens_start}")
