"""The target service's multi-session verifier: one batched forward for many sequences.

Each session keeps the tokens its KV covers and the KV itself (a per-session buffer
``[2, layers, kv_heads, capacity, head_dim]`` that grows by doubling). A verify call
reconstructs every row's committed tokens from ``tokens_start`` (the prefix the session
already holds) plus the tokens sent, repairs the session's cache by content
(``repair_plan``), and then feeds all rows' new tokens in ONE forward of the Hugging Face
model:

* past: each row's KV left-padded to the longest cache P, copied once into a buffer
  [2, layers, B, kv_heads, P + T, head_dim] that the ``DynamicCache``'s layers write the
  new entries into in place (``_InPlaceLayer``; ~15% cheaper than concatenating),
* inputs: each row's new tokens (committed[keep:] + drafts) left-aligned, right-padded to
  the longest count T, so a row's real tokens directly follow its cache,
* a 2D attention mask [B, P + T] that is 1 exactly on each row's real cache entries and
  real inputs (the causal part comes from the index order, which pads do not break;
  omitted when no row is padded), and
* explicit ``position_ids`` [B, T]: each row's true positions, cache length + 0, 1, ...

Each row's logits are read at its last k + 1 real inputs, its real new KV entries are
appended to its own buffer, and ``verify_batch`` decides all rows at once. A session that
is unknown or holds fewer than ``tokens_start`` tokens (evicted, replica restarted) answers
``cache_miss``; the caller resends the full committed list with ``tokens_start = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TargetEngine", "VerifyItem", "VerifyOutcome"]

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specserve.api import MAX_LOGPROBS, TokenLogprob
from specserve.contract import RepairRecord, VerifyItem, VerifyOutcome
from specserve.core.commit import check_tokens_window, repair_plan
from specserve.core.logprobs import logprobs_from_logits, top_logprobs
from specserve.core.sampling import params_tensors
from specserve.core.verify import one_hot_q, verify_batch
from specserve.service.lru import LRUSessions

# Tokens per session recorded in the byte accounting beside the KV (a Python int list).
_TOKEN_BYTES = 8
_MIN_CAPACITY = 64


class _KV:
    """One session's KV entries, ``length`` of ``capacity`` used."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.shape = (2, layers, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.buf = torch.empty(self.shape, dtype=dtype, device=device)  # [2, Ly, KVH, C, D]
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, end: int) -> None:
        """Capacity for ``end`` entries (grows by doubling; the only copy of the past)."""
        cap = self.buf.shape[3]
        if end > cap:
            grown = torch.empty(
                (*self.shape[:3], max(_MIN_CAPACITY, 2 * cap, end), self.shape[4]),
                dtype=self.dtype, device=self.device)
            grown[:, :, :, : self.length] = self.buf[:, :, :, : self.length]
            self.buf = grown

    def append(self, new: torch.Tensor) -> None:  # new: [2, Ly, KVH, n, D]
        end = self.length + new.shape[3]
        self.reserve(end)
        self.buf[:, :, :, self.length : end] = new
        self.length = end


class _InPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` over a preallocated buffer [B, KVH, P+T, D] that already holds the
    padded past: ``update`` writes the new entries in place instead of concatenating."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_len: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self._kbuf, self._vbuf, self._len = keys, values, past_len
        self.keys, self.values = keys[:, :, :past_len], values[:, :, :past_len]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._len + key_states.shape[-2]
        self._kbuf[:, :, self._len : end] = key_states
        self._vbuf[:, :, self._len : end] = value_states
        self._len = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values


def _padded_past(config: object, kv: torch.Tensor, p: int) -> DynamicCache:
    # kv: [2, Ly, B, KVH, P+T, D], the first P entries per row are the (left-padded) past
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [_InPlaceLayer(kv[0, j], kv[1, j], p) for j in range(kv.shape[1])]
    elif p > 0:  # other layer kinds: the generic (copying) path
        cache = DynamicCache(ddp_cache_data=[(kv[0, j, :, :, :p], kv[1, j, :, :, :p])
                                             for j in range(kv.shape[1])], config=config)
    return cache


def _in_place_ok(config: object) -> bool:
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def _read_back(cache: DynamicCache, kv: torch.Tensor, row: int, p: int, n: int) -> torch.Tensor:
    """Row ``row``'s n new entries after the forward: [2, Ly, KVH, n, D]."""
    if all(isinstance(layer, _InPlaceLayer) for layer in cache.layers):
        return kv[:, :, row, :, p : p + n]
    return torch.stack([
        torch.stack([layer.keys[row, :, p : p + n] for layer in cache.layers]),
        torch.stack([layer.values[row, :, p : p + n] for layer in cache.layers]),
    ])


@dataclass
class _Session:
    tokens: list[int]  # what the KV covers: the last committed list + its drafts
    kv: _KV

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + _TOKEN_BYTES * len(self.tokens)


@dataclass
class _Row:
    item: VerifyItem
    session: _Session
    committed: list[int]
    feed: list[int]  # committed[keep:] + drafts
    past_len: int  # KV entries kept (= keep)
    repair: RepairRecord


class TargetEngine(LRUSessions):
    """Verifies draft blocks of many sessions with one target forward per call."""

    def __init__(self, model: torch.nn.Module, cache_budget_bytes: int = 512 << 20,
                 tp_size: int = 1, batch_invariant: bool = False):
        """``tp_size`` > 1: ``model`` is one rank's tensor-parallel shard, which holds
        ``num_key_value_heads / tp_size`` KV heads (see ``target_service/tp.py``).
        ``batch_invariant``: every row is its own forward (no padding, no other rows in its
        matmuls), so a row's logits are bitwise those it gets alone: CPU/GPU matmul kernels
        change their reduction order with the batch's shape (measured here: a row of a
        linear layer differs in its last bits between 1-3 and >= 4 rows), which moves a
        seeded sample sitting within ~1e-8 of a token boundary. Costs one forward per row."""
        super().__init__(cache_budget_bytes)
        cfg = model.config
        self.model = model
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(cfg.max_position_embeddings)
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(cfg.num_key_value_heads) // tp_size
        self.head_dim = int(getattr(cfg, "head_dim", None)
                            or cfg.hidden_size // cfg.num_attention_heads)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.in_place = _in_place_ok(cfg)  # plain DynamicLayers: writable in place
        self.batch_invariant = batch_invariant
        self.forward_batches = 0
        self.rows_verified = 0
        self.max_batch_size_seen = 0

    # ----------------------------------------------------------------- sessions
    def stats(self) -> dict[str, int]:
        return {
            **self.lru_stats(),
            "forward_batches": self.forward_batches,
            "rows_verified": self.rows_verified,
            "max_batch_size_seen": self.max_batch_size_seen,
        }

    # ----------------------------------------------------------------- checks
    def _check(self, items: Sequence[VerifyItem]) -> None:
        seen: set[str] = set()
        for it in items:
            sid = it.session_id
            if sid in seen:
                raise ValueError(f"session {sid!r} appears twice in one verify call")
            seen.add(sid)
            check_tokens_window(sid, it.committed_len, it.tokens_start, it.tokens)
            k = len(it.draft_tokens)
            if it.committed_len + k > self.max_context:
                raise ValueError(
                    f"session {sid!r}: committed_len ({it.committed_len}) + drafts ({k}) "
                    f"exceeds the target's context ({self.max_context})")
            bad = [t for t in (*it.tokens, *it.draft_tokens) if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"session {sid!r}: token id {bad[0]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            if it.draft_probs is not None and tuple(it.draft_probs.shape) != (k, self.vocab_size):
                raise ValueError(
                    f"session {sid!r}: draft_probs has shape {tuple(it.draft_probs.shape)}, "
                    f"expected [k={k}, V={self.vocab_size}]")
            if not it.sampling.greedy and it.sampling.seed is None:
                raise ValueError(f"session {sid!r}: a sampled row needs sampling.seed")
            if it.logprobs is not None and not 0 <= it.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"session {sid!r}: logprobs must be in [0, {MAX_LOGPROBS}]")

    # ----------------------------------------------------------------- verify
    @torch.inference_mode()
    def verify(self, items: list[VerifyItem]) -> list[VerifyOutcome]:
        """Verify every item's drafts; ONE model forward for all rows that are not misses."""
        self._check(items)
        outcomes: list[VerifyOutcome | None] = [None] * len(items)
        rows: list[tuple[int, _Row]] = []
        for idx, it in enumerate(items):
            sess = self._sessions.get(it.session_id)
            if it.tokens_start > 0 and (sess is None or len(sess.tokens) < it.tokens_start):
                self.misses += 1
                outcomes[idx] = VerifyOutcome(0, -1, False, True, None, 0)
                continue
            if sess is None:
                sess = _Session([], _KV(self.layers, self.kv_heads, self.head_dim, self.dtype,
                                        self.device))
                self._sessions[it.session_id] = sess
            committed = [*sess.tokens[: it.tokens_start], *it.tokens]
            plan = repair_plan(sess.tokens, committed)
            repair = RepairRecord(len(sess.tokens), plan.keep, len(committed) - plan.keep)
            sess.kv.crop(plan.keep)
            sess.tokens = committed[: plan.keep]
            rows.append((idx, _Row(it, sess, committed,
                                   [*committed[plan.keep :], *it.draft_tokens], plan.keep,
                                   repair)))
        if rows:
            logits = self._forward([r for _, r in rows])  # [B, K+1, V]
            results = self._decide([r for _, r in rows], logits)
            logprobs = self._logprobs([r for _, r in rows], logits, results)
            tokens = sum(len(r.item.draft_tokens) + 1 for _, r in rows)
            for (idx, row), (n, extra, bonus), lp in zip(rows, results, logprobs, strict=True):
                outcomes[idx] = VerifyOutcome(n, extra, bonus, False, row.repair, len(rows),
                                              logprobs=lp, batch_tokens=tokens)
                self._sessions.move_to_end(row.item.session_id)
            self._evict({r.item.session_id for _, r in rows})
        return [o for o in outcomes if o is not None]

    def _forward(self, rows: list[_Row]) -> torch.Tensor:  # -> [B, K+1, V]
        """All rows' logits: one padded forward; with ``batch_invariant``, every sampled row
        is its own forward (its random draws compare against bitwise the same p whatever
        else is in the batch) and the greedy rows share one (argmax needs no last bits)."""
        sampled = [i for i, r in enumerate(rows) if not r.item.sampling.greedy]
        if not self.batch_invariant or len(rows) == 1 or not sampled:
            return self._forward_batch(rows)
        greedy = [i for i in range(len(rows)) if i not in set(sampled)]
        groups = [[i] for i in sampled] + ([greedy] if greedy else [])
        k_max = max(len(r.item.draft_tokens) for r in rows)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for group in groups:
            lg = self._forward_batch([rows[i] for i in group])  # [g, k_g + 1, V]
            for j, i in enumerate(group):  # slots past a row's k repeat its last one
                out[i] = lg[j, torch.arange(k_max + 1).clamp(max=lg.shape[1] - 1)]
        self.forward_batches -= len(groups) - 1  # one verify batch, however computed
        self.max_batch_size_seen = max(self.max_batch_size_seen, len(rows))
        return torch.stack(out)

    def _forward_batch(self, rows: list[_Row]) -> torch.Tensor:  # -> [B, K+1, V]
        b = len(rows)
        p = max(r.past_len for r in rows)
        t = max(len(r.feed) for r in rows)
        k_max = max(len(r.item.draft_tokens) for r in rows)
        dev = self.device

        input_ids = torch.zeros((b, t), dtype=torch.long)  # pads: token 0, masked
        mask = torch.zeros((b, p + t), dtype=torch.long)
        positions = torch.zeros((b, t), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.feed)
            input_ids[i, :n] = torch.tensor(r.feed)
            mask[i, p - r.past_len : p + n] = 1
            # true positions; pads continue the count (masked, clamped into the table)
            positions[i] = (r.past_len + torch.arange(t)).clamp(max=self.max_context - 1)

        past, kv = self._past(rows, p, t)
        # logits only where some row needs them: from the earliest first-verified input on
        first = min(len(r.feed) - len(r.item.draft_tokens) - 1 for r in rows)
        padded = any(r.past_len != p or len(r.feed) != t for r in rows)
        out = self.model(
            input_ids=input_ids.to(dev), attention_mask=mask.to(dev) if padded else None,
            position_ids=positions.to(dev), cache=past, use_cache=True,
            logits_to_keep=t - first,
        )
        self.forward_batches += 1
        self.rows_verified += b
        self.max_batch_size_seen = max(self.max_batch_size_seen, b)

        # each row's k + 1 logits; slots past k repeat its last one (ignored by verify)
        idx = torch.zeros((b, k_max + 1), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r.item.draft_tokens)
            start = len(r.feed) - k - 1 - first
            idx[i] = (start + torch.arange(k_max + 1)).clamp(max=start + k)
        logits = out.logits.float().gather(
            1, idx.to(dev)[:, :, None].expand(-1, -1, out.logits.shape[-1]))  # [B, K+1, V]

        # each row's real new KV entries into its own cache (written in place with one row)
        for i, r in enumerate(rows):
            n = len(r.feed)
            if kv is None:
                r.session.kv.length = r.past_len + n
            else:
                r.session.kv.append(_read_back(past, kv, i, p, n))  # [2, Ly, KVH, n, D]
            r.session.tokens = [*r.committed, *r.item.draft_tokens]
        return logits.cpu()

    def _past(self, rows: list[_Row], p: int, t: int) -> tuple[DynamicCache,
                                                              torch.Tensor | None]:
        """The past for the forward. One row: its own buffer, the new entries written in
        place at their positions (no copy). Several rows: one buffer [2, Ly, B, KVH, P+T, D]
        holding every row's past left-padded to P, the new entries written after it."""
        if len(rows) == 1 and self.in_place:
            r = rows[0]
            r.session.kv.reserve(r.past_len + t)
            buf = r.session.kv.buf  # [2, Ly, KVH, C, D]
            cache = DynamicCache(config=self.config)
            cache.layers = [_InPlaceLayer(buf[0, j][None], buf[1, j][None], r.past_len)
                            for j in range(self.layers)]
            return cache, None
        kv = torch.empty((2, self.layers, len(rows), self.kv_heads, p + t, self.head_dim),
                         dtype=self.dtype, device=self.device)
        for i, r in enumerate(rows):
            pad = p - r.past_len
            kv[:, :, i, :, :pad] = 0.0  # masked; finite so 0-weights stay 0
            kv[:, :, i, :, pad:p] = r.session.kv.buf[:, :, :, : r.past_len]
        return _padded_past(self.config, kv, p), kv

    def _decide(self, rows: list[_Row], logits: torch.Tensor) -> list[tuple[int, int, bool]]:
        # logits: [B, K+1, V]
        b, kp1, v = logits.shape
        k_max = kp1 - 1
        params = [r.item.sampling for r in rows]
        draft = torch.zeros((b, k_max), dtype=torch.long)  # [B, K]
        q = None
        if not all(s.greedy for s in params) and k_max:
            q = torch.zeros((b, k_max, v))  # [B, K, V]; greedy rows keep zeros (unused)
        for i, r in enumerate(rows):
            k = len(r.item.draft_tokens)
            if k:
                d = torch.tensor(r.item.draft_tokens, dtype=torch.long)
                draft[i, :k] = d
                if q is not None and not r.item.sampling.greedy:
                    q[i, :k] = (r.item.draft_probs.float() if r.item.draft_probs is not None
                                else one_hot_q(d[None], v)[0])
        res = verify_batch(
            logits, draft, q,
            torch.tensor([len(r.item.draft_tokens) for r in rows], dtype=torch.long),
            *params_tensors(params),
            np.array([s.seed or 0 for s in params], dtype=np.uint64),
            np.array([r.item.committed_len for r in rows], dtype=np.int64),
        )
        return [(int(res.num_accepted[i]), int(res.extra_token[i]), bool(res.bonus[i]))
                for i in range(b)]

    def _logprobs(self, rows: list[_Row], logits: torch.Tensor,
                  results: list[tuple[int, int, bool]]) -> list[list[TokenLogprob] | None]:
        """Each asking row's logprobs of its committed tokens (accepted drafts + the extra
        token) from the verify logits [B, K+1, V]: position j's logits give token j."""
        out: list[list[TokenLogprob] | None] = []
        for i, (r, (n, extra, _)) in enumerate(zip(rows, results, strict=True)):
            top_n = r.item.logprobs
            if top_n is None:
                out.append(None)
                continue
            tokens = torch.tensor([*r.item.draft_tokens[:n], extra], dtype=torch.long)
            temp, tk, tp = params_tensors([r.item.sampling] * (n + 1))
            logp = logprobs_from_logits(logits[i, : n + 1], temp, tk, tp)  # [n+1, V]
            chosen, ids, values = top_logprobs(logp, tokens, top_n)
            out.append([TokenLogprob(int(t), float(c), list(zip(ids_.tolist(), v_.tolist(),
                                                                  strict=True)))
                        for t, c, ids_, v_ in zip(tokens.tolist(), chosen.tolist(), ids, values,
                                                   strict=True)])
        return out
