"""The target service's multi-session verifier: one batched forward for many sequences.

Every session's KV lives in one preallocated, position-addressed pool per replica
(gpt-fast's static cache, one slot per session): ``[2, layers, slots, kv_heads, L, head_dim]``,
a row's entries at their true positions ``0 .. length``. A verify call reconstructs every
row's committed tokens from ``tokens_start`` (the prefix the session already holds) plus
the tokens sent, repairs the session's cache by content (``repair_plan``; a repair is a
length change), and feeds all rows' new tokens in ONE forward of the Hugging Face model:

* the rows occupy consecutive slots (they normally already do: a step's rows are the same
  sessions as the last step's; otherwise rows are swapped into place, one row copy each),
  so the forward's past is a view of the pool: nothing is copied per round,
* inputs: every row's new tokens (committed[keep:] + drafts) packed one after another into
  one sequence [1, N] with each token's true position, so the projections and the MLP
  compute exactly the real tokens (a prefill or a k=4 row beside k=0 rows adds its own
  tokens only); rows with the same past and feed run as a plain [B, T] batch instead,
* each layer's cache ``update`` writes every token's K/V in place at (its row, its
  position), one indexed write per layer, and returns the pool view up to the longest row,
* attention (``_packed_attention``): the queries scattered into [B, H, T, D], a per-row
  causal mask ``[B, 1, T, keys]`` (query j of row b sees keys ``0 .. len_b + j``), gathered
  back; the uniform batch uses Hugging Face's own mask.

Each row's logits are read at its last k + 1 real inputs and ``verify_batch`` decides all
rows at once. A session that is unknown or holds fewer than ``tokens_start`` tokens
(evicted, replica restarted) answers ``cache_miss``; the caller resends the full committed
list with ``tokens_start = 0``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

__all__ = ["Admission", "TargetEngine", "VerifyItem", "VerifyOutcome"]

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specserve.api import MAX_LOGPROBS, TokenLogprob
from specserve.contract import RepairRecord, VerifyItem, VerifyOutcome
from specserve.core.commit import check_tokens_window, repair_plan
from specserve.core.logprobs import logprobs_from_logits, top_logprobs
from specserve.core.sampling import params_tensors
from specserve.core.verify import one_hot_q, verify_batch
from specserve.service.lru import LRUSessions

# Tokens per session recorded in the byte accounting beside the KV (a Python int list).
_TOKEN_BYTES = 8
_MIN_CAPACITY = 64  # the pool's length grows and shrinks in blocks of this many entries


def _blocks(length: int) -> int:
    return _MIN_CAPACITY * -(-max(length, _MIN_CAPACITY) // _MIN_CAPACITY)


class UnsupportedTargetError(ValueError):
    """The target model's cache is not plain full attention (sliding or linear layers)."""


@dataclass
class _Session:
    tokens: list[int]  # what the KV covers: the last committed list + its drafts
    slot: int = -1
    length: int = 0  # valid KV entries
    pool: _Pool | None = None
    order: int = 0  # when it was admitted (preemption takes the newest first)
    chunked: RepairRecord | None = None  # a call's repair while its prefill runs in chunks

    @property
    def nbytes(self) -> int:  # its slot at the pool's current length
        slot = self.pool.slot_bytes if self.pool is not None else 0
        return slot + _TOKEN_BYTES * len(self.tokens)


class _Pool:
    """Every session's KV: ``buf`` [2, Ly, S, KVH, L, D], slot s owned by ``owner[s]``.
    Grows by doubling its slots, or its length by a quarter (``grown``): the only copy of
    the past besides moving a row into place. Never past ``budget_bytes`` of slots except
    to hold the sessions it has: growing the length compacts the live slots into fewer,
    longer ones."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int = 1 << 62):
        self.buf = torch.empty((2, layers, 0, kv_heads, 0, head_dim), dtype=dtype,
                               device=device)
        self.owner: list[_Session | None] = []
        self.budget_bytes = budget_bytes

    @property
    def capacity(self) -> int:
        return self.buf.shape[4]

    @property
    def slot_bytes(self) -> int:
        return self.slot_bytes_at(self.capacity)

    def holds(self, sessions: int, length: int) -> bool:
        """Whether the budget holds ``sessions`` sessions at pool length ``length``, each
        its slot and its token list: the one check of admission and of ``fitted``."""
        return sessions * (self.slot_bytes_at(length) + _TOKEN_BYTES * length) \
            <= self.budget_bytes

    def slot_bytes_at(self, length: int) -> int:
        s = self.buf.shape
        return 2 * s[1] * s[3] * length * s[5] * self.buf.element_size()

    def grown(self, length: int) -> int:
        """The capacity after ``reserve(length=length)``: by a quarter at a time, in whole
        ``_MIN_CAPACITY`` blocks. Every slot has the pool's length, so a pool that doubled
        to hold its longest session priced every session at up to twice that and held as
        few as half the sessions the budget allows (the KV-bound loads); a growth copies
        the live entries, a few dozen times over the pool's life at a quarter."""
        have = self.capacity
        if length <= have:
            return have
        return _blocks(max(length, have * 5 // 4))

    def fitted(self, length: int, live: int, sessions: int) -> int:
        """The capacity after ``reserve(length=length, fit=True)`` with ``sessions`` live
        sessions, the longest of them ``live`` entries long. Grown as ``grown``; shrunk to a
        quarter over the longest of the two where they use at most half of it and the
        budget holds no session more at the length it has: a long session that left no
        longer prices every slot (one 32k-token request would otherwise leave a replica
        holding a few sessions until it restarts), and a pool with room to spare is not
        copied (a shrink and the growth after it cost a copy of the live entries each)."""
        need, have = max(length, live), self.capacity
        if need > have or 2 * need > have or self.holds(sessions + 1, have):
            return self.grown(need)
        return _blocks(need * 5 // 4)

    def reserve(self, slots: int, length: int, fit: bool = False) -> None:
        """Room for ``slots`` slots of ``length`` entries (``grown``); ``fit``: the length
        may shrink too (``fitted``)."""
        have_s, have_l = self.buf.shape[2], self.capacity
        if slots <= have_s and length <= have_l and not (fit and 2 * length <= have_l):
            return  # every step: neither grown nor shrunk (a shrink needs the rows to use
            # at most half of it), so no walk over the slots
        live = [s for s in self.owner if s is not None]
        new_l = (self.fitted(length, max((s.length for s in live), default=0), len(live))
                 if fit else self.grown(length))
        if slots <= have_s and new_l == have_l:
            return
        fits = self.budget_bytes // max(self.slot_bytes_at(new_l), 1)
        want = max(slots, 2 * have_s, 4) if slots > have_s else have_s
        new_s = max(slots, len(live), min(want, fits))
        b = self.buf.shape
        # zeros: attention reads every slot up to the longest row (masked, weight 0), and
        # 0 * garbage could be NaN; stale entries of earlier sessions are finite
        grown = torch.zeros((b[0], b[1], new_s, b[3], new_l, b[5]), dtype=self.buf.dtype,
                            device=self.buf.device)
        if new_s >= have_s:  # slots keep their numbers
            used = max((s.length for s in live), default=0)
            grown[:, :, :have_s, :, :used] = self.buf[:, :, :, :, :used]
            self.owner += [None] * (new_s - have_s)
        else:  # fewer, longer slots: the live ones move to the front, in slot order
            for j, sess in enumerate(sorted(live, key=lambda s: s.slot)):
                grown[:, :, j, :, : sess.length] = self.buf[:, :, sess.slot, :, : sess.length]
                sess.slot = j
            self.owner = [*sorted(live, key=lambda s: s.slot), *[None] * (new_s - len(live))]
        self.buf = grown

    def assign(self, sess: _Session) -> None:
        if None not in self.owner:
            self.reserve(len(self.owner) + 1, self.capacity)
        sess.slot = self.owner.index(None)
        self.owner[sess.slot] = sess

    def free(self, sess: _Session) -> None:
        if 0 <= sess.slot < len(self.owner) and self.owner[sess.slot] is sess:
            self.owner[sess.slot] = None
        sess.slot = -1

    def place(self, sessions: list[_Session]) -> int:
        """Put ``sessions`` in consecutive slots (in some order; their ``slot`` fields tell
        which) moving as few rows as possible; returns the first slot."""
        slots = sorted(s.slot for s in sessions)
        if slots[-1] - slots[0] == len(slots) - 1:
            return slots[0]
        b = len(sessions)
        inside = {s.slot for s in sessions if s.slot < b}
        holes = [j for j in range(b) if j not in inside]
        for sess, hole in zip([s for s in sessions if s.slot >= b], holes, strict=True):
            self._swap(sess.slot, hole)
        return 0

    def _swap(self, a: int, b: int) -> None:
        sa, sb = self.owner[a], self.owner[b]
        na = sa.length if sa is not None else 0
        nb = sb.length if sb is not None else 0
        saved = self.buf[:, :, b, :, :nb].clone()
        self.buf[:, :, b, :, :na] = self.buf[:, :, a, :, :na]
        self.buf[:, :, a, :, :nb] = saved
        self.owner[a], self.owner[b] = sb, sa
        for sess, slot in ((sa, b), (sb, a)):
            if sess is not None:
                sess.slot = slot


class _SlotLayer(DynamicLayer):
    """A cache layer over consecutive pool slots [B, KVH, L, D]: ``update`` writes the new
    entries of every token at (its row, its position) in one indexed write (the step's
    tokens in row-major order, padded [B, T] or packed [1, N] alike) and returns the keys
    and values of the slots up to ``keys`` entries (the longest row's length + T)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor, keys: int, past: int):
        super().__init__()
        self._k, self._v, self._rows, self._pos, self._n = k, v, rows, positions, keys
        self._past = past
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, KVH, T, D] (or [1, KVH, N, D]) -> one [KVH, D] entry per token
        kvh, d = key_states.shape[1], key_states.shape[3]
        self._k[self._rows, :, self._pos] = key_states.transpose(1, 2).reshape(-1, kvh, d)
        self._v[self._rows, :, self._pos] = value_states.transpose(1, 2).reshape(-1, kvh, d)
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
        return self.keys, self.values

    def get_seq_length(self) -> int:  # the rows' common past (Hugging Face's causal mask)
        return self._past


_PACKED = "specserve_packed"


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """Attention of a packed step: ``query`` [1, H, N, D] (every row's tokens one after
    another), ``key``/``value`` the rows' pool slots [B, KVH, keys, D]. Per run of rows
    (``_Run``), the queries are scattered into [rows, H, T, D] (row, index in its feed),
    attend under the per-row causal mask [rows, 1, T, keys] and are gathered back. Any
    other call: plain SDPA."""
    runs: list[_Run] | None = kwargs.pop("specserve_packed", None)
    if runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    h, d = query.shape[1], query.shape[3]
    out = []
    for run in runs:
        b = run.rows.stop - run.rows.start
        q = query.new_zeros((b * run.t, h, d))
        q[run.where] = query[0, :, run.tokens].transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.view(b, run.t, h, d).transpose(1, 2), key[run.rows, :, : run.keys],
            value[run.rows, :, : run.keys], attn_mask=run.mask, scale=scaling,
            enable_gqa=key.shape[1] != h)  # [rows, H, T, D]
        out.append(o.transpose(1, 2).reshape(b * run.t, h, d)[run.where])
    return (out[0] if len(out) == 1 else torch.cat(out))[None], None


def _feeds(needs: list[int], alone: list[bool], chunk: int | None,
           budget: int | None) -> list[int]:
    """Committed tokens each row feeds this step, of the ``needs`` it has to catch up (0:
    it waits). A row with at most ``chunk`` to feed decodes and feeds all of it. A prefill
    feeds at most ``chunk`` beside such a row (or when ``alone``: then exactly a chunk or
    nothing, so its chunks' bounds never depend on the batch), and the prefills together at
    most ``budget``, first come first served; the first always feeds."""
    if chunk is None:
        return list(needs)
    decoding = any(n <= chunk for n in needs)
    left = budget if budget is not None else sum(needs)
    out = []
    for n, one in zip(needs, alone, strict=True):
        if n <= chunk:
            out.append(n)
            continue
        want = min(n, chunk) if decoding or one else n
        give = want if left >= want else 0 if one else left
        out.append(give)
        left -= give
    return out


@dataclass
class _Run:
    """Consecutive rows of a packed step (pool order) whose attention is one padded call:
    the decoding rows apart from a prefill's chunk, so their queries are padded to their
    own few tokens, not to the chunk, and read only their own keys (``_runs``)."""

    rows: slice  # of the step's rows
    tokens: slice  # of the packed sequence
    where: torch.Tensor  # each token's place in [rows * t]
    t: int  # the run's longest feed
    keys: int  # the run's longest past + feed
    mask: torch.Tensor  # [rows, 1, t, keys]: query j of row b sees keys 0 .. past_b + j


# a row that feeds more than its drafts and this many tokens (a prefill's chunk, a rebuild)
# is attended apart from the decoding rows beside it
_RUN_SLACK = 2


def _runs(feeds: list[int], past: torch.Tensor, row_tok: torch.Tensor, j_tok: torch.Tensor,
          short: int, device: torch.device) -> list[_Run]:
    """The packed step's rows split into maximal runs of short (feed <= ``short``) and
    long rows; ``row_tok`` / ``j_tok``: each packed token's row and index in its feed."""
    runs: list[_Run] = []
    row, tok = 0, 0
    while row < len(feeds):
        kind = feeds[row] <= short
        end = row
        while end < len(feeds) and (feeds[end] <= short) == kind:
            end += 1
        n, p = feeds[row:end], past[row:end]
        t, size = max(n), sum(n)
        keys = max(a + b for a, b in zip(p.tolist(), n, strict=True))
        where = (row_tok[tok: tok + size] - row) * t + j_tok[tok: tok + size]
        mask = torch.arange(keys)[None, None, None, :] <= \
            (p[:, None] + torch.arange(t))[:, None, :, None]
        runs.append(_Run(slice(row, end), slice(tok, tok + size), where.to(device), t,
                         keys, mask.to(device)))
        row, tok = end, tok + size
    return runs


AttentionInterface.register(_PACKED, _packed_attention)
AttentionMaskInterface.register(_PACKED, sdpa_mask)


@contextlib.contextmanager
def _attention(config: object, implementation: str) -> Iterator[None]:
    """The model's attention implementation for one call (the engine's calls are serial)."""
    before = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def _check_layers(config: object) -> None:
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds - {"DynamicLayer"}:
        raise UnsupportedTargetError(
            f"the target engine needs full-attention layers; this model's cache has "
            f"{sorted(kinds)}")


@dataclass
class Admission:
    """A step's admission (``TargetEngine.admission``): ``run[i]`` row i runs now (else it
    waits for room); ``preempt``: sessions to release first."""

    run: list[bool]
    preempt: list[str]


@dataclass
class _Row:
    item: VerifyItem
    session: _Session
    committed: list[int]
    feed: list[int]  # committed[keep:] + drafts
    past_len: int  # KV entries kept (= keep)
    repair: RepairRecord
    pending: bool = False  # a chunk of its prefill: no verdict yet (``verify``)


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
        _check_layers(cfg)
        self.pool = _Pool(self.layers, self.kv_heads, self.head_dim, self.dtype, self.device,
                          cache_budget_bytes)
        self._admitted = 0  # sessions admitted so far (their ``order``)
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

    def _dropped(self, session: _Session) -> None:
        self.pool.free(session)

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

    def validate(self, item: VerifyItem) -> None:
        """Raise ValueError if ``item`` alone would be refused (``verify`` checks the whole
        list at once; a server checks each row first so a bad one fails alone)."""
        self._check([item])

    # ----------------------------------------------------------------- admission
    def admission(self, items: Sequence[VerifyItem], overdue: Sequence[bool] | None = None,
                  gone: frozenset[str] = frozenset()) -> Admission:
        """Which rows of a step run now under the KV budget, and which sessions to preempt.

        The budget holds ``budget // session_bytes(pool length)`` sessions, at the length
        the step's forward gives the pool (``_Pool.fitted``). A row of a held
        session always runs; a row that needs a new slot runs only while one fits (oldest
        first), else it waits for a release: admitting it by evicting a session still in use
        would bring that one back at once as a cache miss that evicts another, LRU thrash.
        When held
        sessions grow past the pool's length and no longer fit, the newest are preempted
        (released: their next row misses, and the resend waits here like a new session;
        vLLM's preemption by recompute). An ``overdue`` row (it waited too long) runs by
        evicting the least recently used session outside the step. At least one session
        always runs, whatever its size. ``gone``: sessions released but not yet applied."""
        mine = [it.session_id in self._sessions and it.session_id not in gone for it in items]
        need = max((it.committed_len + len(it.draft_tokens) for it, m in zip(items, mine,
                                                                               strict=True)
                    if m), default=0)
        longest = max((s.length for sid, s in self._sessions.items() if sid not in gone),
                      default=0)
        n_held = len(self._sessions) - sum(sid in self._sessions for sid in gone)
        length = self.pool.fitted(need, longest, n_held)  # what the step's forward makes it
        if all(mine) and (n_held <= 1 or self.pool.holds(n_held, length)):
            return Admission([True] * len(items), [])  # the steady state: all held, all fit
        overdue = overdue or [False] * len(items)
        held = {sid for sid in self._sessions if sid not in gone}
        preempt = []
        by_age = sorted(held, key=lambda sid: self._sessions[sid].order)
        while len(by_age) > 1 and not self.pool.holds(len(by_age), length):
            preempt.append(by_age.pop())
        live = {*by_age}
        step = {it.session_id for it, m in zip(items, mine, strict=True) if m}
        run = []
        for it, is_held, late in zip(items, mine, overdue, strict=True):
            if is_held or it.tokens_start > 0:  # held, or a miss (answered at once)
                run.append(True)
                continue
            ends = max(need, it.committed_len + len(it.draft_tokens))
            grown = self.pool.fitted(ends, longest, len(live))
            if late:  # room by evicting the least recently used sessions outside the step
                for sid in [s for s in self._sessions if s in live and s not in step]:
                    if self.pool.holds(len(live) + 1, grown):
                        break
                    preempt.append(sid)
                    live.discard(sid)
            ok = late or not live or self.pool.holds(len(live) + 1, grown)
            run.append(ok)
            if ok:
                live.add(it.session_id)
                step.add(it.session_id)
                need, length = ends, grown
        return Admission(run, preempt)

    # ----------------------------------------------------------------- verify
    @torch.inference_mode()
    def verify(self, items: list[VerifyItem], prefill_chunk: int | None = None,
               prefill_budget: int | None = None) -> list[VerifyOutcome]:
        """Verify every item's drafts; ONE model forward for all rows that are not misses.

        ``prefill_chunk``: a row with more committed tokens to feed than this (a prefill, a
        rebuild after a loss) may feed only a part of them and answer ``pending``: the
        caller sends the same item again in a later call, which goes on from there (the
        cache holds the part). Beside a decoding row (one with at most a chunk to feed) such
        a row feeds at most ``prefill_chunk`` a step, so one arrival's prefill adds at most a
        chunk to their step instead of stalling it for the whole prompt (Sarathi's chunked
        prefill); with nobody to stall, a prompt is fed whole (chunks there cost a lone
        request's first token 1.2-1.6x). A sampled row with ``batch_invariant`` is chunked
        either way, so its cache's bits do not depend on the rest of the batch.

        ``prefill_budget`` (with ``prefill_chunk``, at least it): the prefill tokens one step
        feeds at most, all such rows together, first come first served (``_feeds``). A row
        past the budget feeds what is left of it or waits, unfed (``pending``). A burst of
        arrivals then has its prompts fed a few at a time, so the first ones answer while the
        rest still prefill, in steps of the size the CPU runs fastest per token, instead of
        all of them answering after one step of every prompt."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_budget is not None and (prefill_chunk is None
                                           or prefill_budget < prefill_chunk):
            raise ValueError(f"prefill_budget ({prefill_budget}) needs a prefill_chunk and "
                             f"must be >= it ({prefill_chunk})")
        self._check(items)
        outcomes: list[VerifyOutcome | None] = [None] * len(items)
        planned: list[tuple[int, VerifyItem, _Session, list[int], int]] = []
        for idx, it in enumerate(items):
            sess = self._sessions.get(it.session_id)
            if it.tokens_start > 0 and (sess is None or len(sess.tokens) < it.tokens_start):
                self.misses += 1
                outcomes[idx] = VerifyOutcome(0, -1, False, True, None, 0)
                continue
            if sess is None:
                self._admitted += 1
                sess = _Session([], pool=self.pool, order=self._admitted)
                self.pool.assign(sess)
                self._sessions[it.session_id] = sess
            committed = [*sess.tokens[: it.tokens_start], *it.tokens]
            planned.append((idx, it, sess, committed, repair_plan(sess.tokens, committed).keep))
        feeds = _feeds([len(c) - keep for *_, c, keep in planned],
                       [self.batch_invariant and not it.sampling.greedy
                        for _, it, *_ in planned], prefill_chunk, prefill_budget)
        rows = [(idx, self._row(it, sess, committed, keep, feed))
                for (idx, it, sess, committed, keep), feed in zip(planned, feeds, strict=True)
                if feed]
        waiting = [idx for (idx, *_), feed in zip(planned, feeds, strict=True) if not feed]
        if rows:
            live = [(i, r) for i, r in rows if not r.pending]
            logits = self._forward([r for _, r in rows])  # [B, K+1, V]
            if len(live) < len(rows):  # the verdicts' rows only (one copy of their logits)
                logits = logits[[j for j, (_, r) in enumerate(rows) if not r.pending]]
            results = self._decide([r for _, r in live], logits) if live else []
            logprobs = self._logprobs([r for _, r in live], logits, results)
            tokens = sum(len(r.item.draft_tokens) + 1 for _, r in live)
            fed = sum(len(r.feed) for _, r in rows)
            for (idx, row), (n, extra, bonus), lp in zip(live, results, logprobs, strict=True):
                outcomes[idx] = VerifyOutcome(n, extra, bonus, False, row.repair, len(rows),
                                              logprobs=lp, batch_tokens=tokens,
                                              batch_fed=fed)
            for idx in [i for i, row in rows if row.pending] + waiting:
                outcomes[idx] = VerifyOutcome(0, -1, False, batch_size=len(rows),
                                              batch_tokens=tokens, batch_fed=fed,
                                              pending=True)
            for _, row in rows:
                self._sessions.move_to_end(row.item.session_id)
            self._evict({items[i].session_id for i, _ in rows}
                        | {items[i].session_id for i in waiting})
        return [o for o in outcomes if o is not None]

    @staticmethod
    def _row(it: VerifyItem, sess: _Session, committed: list[int], keep: int,
             feed: int) -> _Row:
        """The row's cache repair and feed (committed[keep:] + drafts), or with ``feed``
        short of that catch-up, its next ``feed`` tokens alone (no drafts: ``pending``)."""
        first = sess.chunked  # the call's first chunk's repair: the whole call's
        repair = RepairRecord(len(sess.tokens), keep, len(committed) - keep) \
            if first is None else RepairRecord(first.cached_before, first.kept,
                                               len(committed) - first.kept)
        sess.length = min(sess.length, keep)
        sess.tokens = committed[:keep]
        if len(committed) - keep > feed:
            sess.chunked = repair
            end = keep + feed
            part = replace(it, draft_tokens=[], draft_probs=None, logprobs=None)
            return _Row(part, sess, committed[:end], committed[keep:end], keep, repair,
                        pending=True)
        sess.chunked = None
        return _Row(it, sess, committed, [*committed[keep:], *it.draft_tokens], keep, repair)

    def _forward(self, rows: list[_Row]) -> torch.Tensor:  # -> [B, K+1, V]
        """All rows' logits in one forward; with ``batch_invariant`` every sampled row is its
        own forward (its random draws compare against bitwise the same p whatever else is in
        the batch) and the greedy rows share one (argmax needs no last bits)."""
        groups = self._groups(rows)
        if len(groups) == 1:
            return self._forward_batch(rows)
        k_max = max(len(r.item.draft_tokens) for r in rows)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for group in groups:
            lg = self._forward_batch([rows[i] for i in group])  # [g, k_g + 1, V]
            for j, i in enumerate(group):  # slots past a row's k repeat its last one
                out[i] = lg[j, torch.arange(k_max + 1).clamp(max=lg.shape[1] - 1)]
        self.forward_batches -= len(groups) - 1  # one verify batch, however computed
        self.max_batch_size_seen = max(self.max_batch_size_seen, len(rows))
        return torch.stack(out)

    def _groups(self, rows: list[_Row]) -> list[list[int]]:
        """Row indices per forward: with ``batch_invariant`` every sampled row alone, the
        others together (mixed feeds cost their own tokens only: ``_packed``)."""
        alone = [i for i, r in enumerate(rows)
                 if self.batch_invariant and not r.item.sampling.greedy and len(rows) > 1]
        rest = [i for i in range(len(rows)) if i not in set(alone)]
        return [[i] for i in alone] + ([rest] if rest else [])

    def _forward_batch(self, rows: list[_Row]) -> torch.Tensor:  # -> [B, K+1, V]
        b = len(rows)
        t = max(len(r.feed) for r in rows)
        # the longest row's end, not the longest past + the longest feed: a prefill beside
        # rows with a long past once grew the pool past anything a session needed (to twice
        # the model's context), which halved the sessions the KV budget held for good
        keys = max(r.past_len + len(r.feed) for r in rows)
        self.pool.reserve(0, keys, fit=True)  # slots: those it has, fewer if longer
        first_slot = self.pool.place([r.session for r in rows])
        back = torch.tensor([r.session.slot - first_slot for r in rows])  # caller's order
        rows = sorted(rows, key=lambda r: r.session.slot)  # the pool's order
        kv = self.pool.buf[:, :, first_slot : first_slot + b]  # [2, Ly, B, KVH, L, D]
        uniform = all(r.past_len == rows[0].past_len and len(r.feed) == t for r in rows)
        run = self._padded if uniform else self._packed
        logits = run(rows, kv, t, keys)  # [B, K+1, V]
        self.forward_batches += 1
        self.rows_verified += b
        self.max_batch_size_seen = max(self.max_batch_size_seen, b)
        for r in rows:
            r.session.length = r.past_len + len(r.feed)
            r.session.tokens = [*r.committed, *r.item.draft_tokens]
        return logits.cpu()[back]

    def _cache(self, kv: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, keys: int,
               past: int) -> DynamicCache:
        cache = DynamicCache(config=self.config)
        dev = self.device
        cache.layers = [_SlotLayer(kv[0, j], kv[1, j], rows.to(dev), pos.to(dev), keys, past)
                        for j in range(self.layers)]
        return cache

    def _padded(self, rows: list[_Row], kv: torch.Tensor, t: int, keys: int) -> torch.Tensor:
        """Every row has the same past and feed: one [B, T] forward, Hugging Face's own
        causal mask (what a row alone gets)."""
        b, past = len(rows), rows[0].past_len
        pos = past + torch.arange(t).expand(b, t)
        cache = self._cache(kv, torch.arange(b).repeat_interleave(t), pos.flatten(), keys, past)
        first = min(len(r.feed) - len(r.item.draft_tokens) - 1 for r in rows)
        out = self.model(input_ids=torch.tensor([r.feed for r in rows]).to(self.device),
                         position_ids=pos.clamp(max=self.max_context - 1).to(self.device),
                         cache=cache, use_cache=True, logits_to_keep=t - first)
        k_max = max(len(r.item.draft_tokens) for r in rows)
        idx = torch.zeros((b, k_max + 1), dtype=torch.long)
        for i, r in enumerate(rows):  # each row's k + 1 logits; past k: its last one again
            k = len(r.item.draft_tokens)
            start = len(r.feed) - k - 1 - first
            idx[i] = (start + torch.arange(k_max + 1)).clamp(max=start + k)
        lg = out.logits
        return lg.float().gather(1, idx.to(lg.device)[:, :, None].expand(-1, -1, lg.shape[-1]))

    def _packed(self, rows: list[_Row], kv: torch.Tensor, t: int, keys: int) -> torch.Tensor:
        """Rows of different pasts or feeds: their tokens packed into one sequence [1, N], so
        projections and MLP compute exactly the real tokens (no padding to the longest feed:
        a prefill or a k=4 row beside k=0 rows costs its own tokens only); attention runs on
        padded [rows, H, T, D] views of the queries against the rows' pool slots, a
        prefill's chunk apart from the decoding rows (``_packed_attention``)."""
        n = [len(r.feed) for r in rows]
        past = torch.tensor([r.past_len for r in rows])
        row_tok = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(n))
        j_tok = torch.cat([torch.arange(m) for m in n])
        pos_tok = past[row_tok] + j_tok
        ends = torch.tensor(n).cumsum(0)
        keep = torch.cat([end - len(r.item.draft_tokens) - 1 + torch.arange(
            len(r.item.draft_tokens) + 1) for r, end in zip(rows, ends.tolist(), strict=True)])
        dev = self.device
        k_max = max(len(r.item.draft_tokens) for r in rows)
        runs = _runs(n, past, row_tok, j_tok, k_max + 1 + _RUN_SLACK, dev)
        with _attention(self.model.config, _PACKED):
            out = self.model(  # the mask is the runs' (the model's own is a placeholder)
                input_ids=torch.tensor([[x for r in rows for x in r.feed]]).to(dev),
                attention_mask=runs[0].mask, position_ids=pos_tok.clamp(
                    max=self.max_context - 1)[None].to(dev),
                cache=self._cache(kv, row_tok, pos_tok, keys, 0), use_cache=True,
                logits_to_keep=keep.to(dev), specserve_packed=runs)
        starts = torch.tensor([0, *[len(r.item.draft_tokens) + 1 for r in rows]]).cumsum(0)
        idx = torch.stack([s + torch.arange(k_max + 1).clamp(max=len(r.item.draft_tokens))
                           for s, r in zip(starts[:-1].tolist(), rows, strict=True)])
        return out.logits[0].float()[idx.to(out.logits.device)]  # [B, K+1, V]

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
