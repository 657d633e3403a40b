"""Model-free prompt-lookup proposer: q is one-hot on each proposed token.

Find the most recent earlier occurrence of the context's last n tokens (n from ``max_n``
down to ``min_n``) and propose the tokens that followed it.

A request's context only grows between rounds, and spec=auto searches it every round, on
the router's event loop, before the round's proposer call: a scan of the whole context
(numpy, four n's) took ~90 us at 600 tokens and grew with the context. ``NgramIndex``
keeps, per n, the last start of every n-gram seen, so a search costs the new tokens since
the last one (a dict update each) and one lookup per n.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """``propose_ngram`` over a context that grows between calls: each call indexes the
    tokens added since the last and looks the context's suffixes up. A context that is not
    an extension of the last one (a rollback, another sequence) is indexed afresh."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._tokens: list[int] = []
        # per n: n-gram -> the start of its last occurrence that ends before the context's
        # last token (an occurrence with a token after it)
        self._last: dict[int, dict[tuple[int, ...], int]] = {}

    @property
    def nbytes(self) -> int:
        """About what it holds (a table entry with its n-gram ~130 bytes, measured)."""
        return 8 * len(self._tokens) + 130 * sum(len(t) for t in self._last.values())

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        self._sync(tokens)
        seq, length = self._tokens, len(self._tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._last.get(n, {}).get(tuple(seq[length - n:]))
            if start is not None:
                return seq[start + n: start + n + k]
        return []

    def _sync(self, tokens: Sequence[int]) -> None:
        seq = self._tokens
        old = len(seq)
        if len(tokens) < old or list(tokens[:old]) != seq:  # not an extension: afresh
            seq.clear()
            self._last = {}
            old = 0
        seq.extend(int(t) for t in tokens[old:])
        # index the n-grams that end at positions old - 1 .. len - 2 (a token follows each);
        # a later start overwrites an earlier one: the most recent occurrence
        for n in range(self.min_n, self.max_n + 1):
            first, stop = max(old - n, 0), len(seq) - n  # their starts
            if first < stop:
                grams = zip(*(seq[first + j: stop + j] for j in range(n)), strict=True)
                self._last.setdefault(n, {}).update(zip(grams, range(first, stop),
                                                        strict=True))


def propose_ngram(
    tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1
) -> list[int]:
    """One search of ``tokens`` (a fresh ``NgramIndex``; keep one to search a growing
    context again)."""
    return NgramIndex(max_n, min_n).propose(tokens, k)
