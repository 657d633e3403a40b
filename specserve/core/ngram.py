"""Model-free prompt-lookup proposer: q is one-hot on each proposed token.

Find the most recent earlier occurrence of the context's last n tokens (n from ``max_n``
down to ``min_n``) and propose the tokens that followed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(
    tokens: Sequence[int] | np.ndarray, k: int, max_n: int = 4, min_n: int = 1
) -> list[int]:
    if k <= 0:
        return []
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = arr[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
