"""Counter-based random numbers: u = hash(seed, stream, position).

Every uniform a request consumes is a pure function of its seed, a stream name and the
token position it decides. So a request's samples do not depend on which other requests
share its batch, on which replica serves a round, or on a replica restart: nothing but the
seed has to survive. Each (stream, position) is used at most once per request, because a
position is drafted at most once and decided exactly once. The hash is SplitMix64's
finalizer (passes BigCrush as a counter-based generator); 53 bits make a float64.
"""

from __future__ import annotations

import os

import numpy as np
import torch

# Streams: independent uniforms for the drafter's sample, the acceptance test and the
# recovered / bonus / plain sample at a position.
DRAFT, ACCEPT, SAMPLE = 1, 2, 3

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def uniforms(seed: np.ndarray | int, stream: int, positions: np.ndarray | int) -> torch.Tensor:
    """Uniforms in [0, 1) (float64), broadcasting ``seed`` against ``positions``."""
    s = np.asarray(seed, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(_mix(s) ^ (np.uint64(stream) * _GOLDEN)) ^ p
    bits = _mix(key) >> np.uint64(11)
    return torch.from_numpy((bits.astype(np.float64) * (1.0 / (1 << 53))).copy())


def random_seed() -> int:
    """A fresh seed for a request that did not give one."""
    return int.from_bytes(os.urandom(8), "little") >> 1
