"""Conversions between internal protos and the engines' dataclasses."""

from __future__ import annotations

import numpy as np
import torch

from specserve.core.sampling import SamplingParams
from specserve.engine.sessions import RepairRecord
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb


def sampling_from_proto(s: pb.Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                          seed=s.seed)


def sampling_to_proto(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed or 0)


def probs_to_bytes(q: torch.Tensor | None) -> bytes:
    return b"" if q is None else q.float().contiguous().numpy().astype("<f4").tobytes()


def probs_from_bytes(data: bytes, k: int) -> torch.Tensor | None:
    if not data or k == 0:
        return None
    arr = np.frombuffer(data, dtype="<f4")
    if arr.size % k:
        raise ValueError(f"draft_probs holds {arr.size} floats, not a multiple of k={k}")
    return torch.from_numpy(arr.reshape(k, -1).copy())


def repair_to_proto(r: RepairRecord | None) -> pb.CacheRepair | None:
    if r is None:
        return None
    return pb.CacheRepair(cached_before=r.cached_before, kept=r.kept, fed=r.fed)
