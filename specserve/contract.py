"""The one contract between the round and its proposer and verifier, whatever carries it:
direct calls in one process, or the gRPC data path between replicas (``service/wire.py`` is
the only mapping to protos).

    drafter:  ProposeItem -> ProposeOutcome       (draft tokens, q)
    target:   VerifyItem  -> VerifyOutcome        (accepted count, recovered / bonus token)

The tokens window (how a session's cache repairs itself): a call carries
``tokens = committed[tokens_start:committed_len]``; the receiver supplies the prefix from
its own record and repairs its cache by content (``core.commit.repair_plan``). A receiver
that lacks ``committed[:tokens_start]`` (evicted, restarted, another replica) answers
``cache_miss`` and the sender resends every committed token (``call_with_resend``). So a
lost message, a retry or a replica restart converges by the same rule.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from specserve.api import TokenLogprob
from specserve.core.sampling import SamplingParams
from specserve.errors import ProposerFailed

if TYPE_CHECKING:
    from specserve.rounds import RequestState

ProposeMode = Literal["draft", "ngram"]
# q as the drafter computed it: a tensor [k, V] in process; its little-endian f32 bytes on
# the wire (passed through the router untouched); None when greedy or one-hot (ngram).
DraftProbs = torch.Tensor | bytes | None


@dataclass
class RepairRecord:
    """What one call's cache repair did (traced and counted)."""

    cached_before: int  # entries the cache held
    kept: int  # entries kept
    fed: int  # tokens fed before the new work (1-2 normally; more after a loss)

    @property
    def rolled_back(self) -> int:
        return self.cached_before - self.kept


@dataclass
class CallInfo:
    """What the transport observed of one call (set by ``call_with_resend`` and servers)."""

    replica: str = ""
    compute_s: float = 0.0  # the replica's own compute time
    tokens_sent: int = 0  # committed tokens in the first message
    first: bool = True  # the session's first call: a prefill, not a repair
    miss_ns: int | None = None  # when a cache-miss answer arrived (then a full resend)
    call_ns: int = 0  # when the call was sent
    reply_ns: int = 0  # when the (last) reply arrived
    # the replica's own wall clock (0 in process): when it read the (last) call and when it
    # handed the reply to its stream; the hop split of ``observers.RoundTiming``
    received_ns: int = 0
    sent_ns: int = 0

    def hops(self) -> tuple[float, float, float] | None:
        """(send, server, return) seconds of the last call: router -> replica, the replica's
        time other than compute (queue, batching wait, decode / encode), replica -> router;
        None without the replica's stamps. Across hosts send and return carry the clocks'
        skew (their sum does not)."""
        if not (self.received_ns and self.sent_ns and self.reply_ns):
            return None
        start = self.miss_ns if self.miss_ns is not None else self.call_ns
        return ((self.received_ns - start) / 1e9,
                max(0.0, (self.sent_ns - self.received_ns) / 1e9 - self.compute_s),
                (self.reply_ns - self.sent_ns) / 1e9)


@dataclass
class ProposeItem:
    """One proposal request. ``tokens`` = committed[tokens_start:committed_len]."""

    session_id: str
    committed_len: int
    tokens_start: int
    tokens: list[int]
    k: int
    mode: ProposeMode
    sampling: SamplingParams  # seed required when sampling in draft mode
    request_id: str = ""
    traceparent: str = ""


@dataclass
class ProposeOutcome:
    draft_tokens: list[int]
    draft_probs: DraftProbs
    cache_miss: bool = False
    repair: RepairRecord | None = None  # None for ngram (no cache) and on a miss
    call: CallInfo = field(default_factory=CallInfo)
    ahead: bool = False  # drafted ahead, while the last round verified (draft-ahead)
    pushed: bool = False  # ... and pushed to the router before the round: no call made


@dataclass
class VerifyItem:
    """One row of a verify call. ``tokens`` = committed[tokens_start:committed_len]."""

    session_id: str
    committed_len: int
    tokens_start: int
    tokens: list[int]
    draft_tokens: list[int]
    draft_probs: DraftProbs  # q [k, V]; None for greedy or n-gram (one-hot)
    sampling: SamplingParams  # seed always set (required when sampling)
    request_id: str = ""
    traceparent: str = ""
    logprobs: int | None = None  # top-n logprobs wanted for the committed tokens (0..20)


@dataclass
class VerifyOutcome:
    num_accepted: int
    extra_token: int  # recovered (num_accepted < k) or bonus token; -1 on a cache miss
    bonus: bool
    cache_miss: bool = False
    repair: RepairRecord | None = None
    batch_size: int = 0  # rows in the forward this row was part of (0 on a cache miss)
    call: CallInfo = field(default_factory=CallInfo)
    logprobs: list[TokenLogprob] | None = None  # accepted drafts + extra token, if asked
    batch_tokens: int = 0  # positions verified in that forward (sum of k + 1 over its rows)
    queue_rows: int = 0  # rows waiting at the target when this reply left (its load)
    # positions fed in that forward, all its rows: drafts, catch-up and prefill (a step with
    # a prefill in it is not what a round of decoding costs; spec=auto leaves it out)
    batch_fed: int = 0
    # only with ``TargetEngine.verify(prefill_chunk=...)``: the row fed one chunk of its
    # prefill and has no verdict yet; the caller sends it again (the target service does,
    # in its next step: a pending outcome never leaves the replica)
    pending: bool = False


NO_PROPOSAL = ProposeOutcome([], None)


class CacheMissAfterResend(RuntimeError):
    """A receiver still lacked the session after every committed token was sent."""


@dataclass
class Window:
    """Per (request, receiver): the receiver surely holds committed[:start]."""

    start: int = 0
    first: bool = True


Item = TypeVar("Item", ProposeItem, VerifyItem)
Outcome = TypeVar("Outcome", ProposeOutcome, VerifyOutcome)


async def call_with_resend(send: Callable[[Item], Awaitable[Outcome]],
                           make_item: Callable[[int], Item], window: Window,
                           committed_len: int) -> Outcome:
    """Send ``make_item(window.start)``; on a cache miss resend from 0 (the rule above).
    Advances the window: after a reply the receiver holds the whole committed list."""
    info = CallInfo(tokens_sent=committed_len - window.start, first=window.first,
                    call_ns=time.time_ns())
    out = await send(make_item(window.start))
    if out.cache_miss:
        info.miss_ns = time.time_ns()
        out = await send(make_item(0))
        if out.cache_miss:
            raise CacheMissAfterResend("cache miss after a full resend")
    info.replica, info.compute_s, info.reply_ns = out.call.replica, out.call.compute_s, \
        time.time_ns()
    info.received_ns, info.sent_ns = out.call.received_ns, out.call.sent_ns
    out.call = info
    window.start, window.first = committed_len, False
    return out


class SessionProposer:
    """A request's proposer over any transport, ``send(ProposeItem) -> ProposeOutcome``:
    a direct engine call in process, a gRPC stream between replicas. Transport failures
    become ``ProposerFailed`` (the request goes on without speculation)."""

    def __init__(self, send: Callable[[ProposeItem], Awaitable[ProposeOutcome]]):
        self.send = send
        self.window = Window()

    async def propose(self, state: RequestState, k: int, traceparent: str,
                      mode: str | None = None) -> ProposeOutcome:
        committed = state.committed
        mode = mode or state.spec  # the plan's proposer; else the request's mode

        def item(start: int) -> ProposeItem:
            return ProposeItem(state.session_id, len(committed), start, committed[start:], k,
                               mode, state.sampling, state.request_id, traceparent)

        try:
            return await call_with_resend(self.send, item, self.window, len(committed))
        except (ConnectionError, TimeoutError, CacheMissAfterResend) as e:
            raise ProposerFailed(str(e)) from e


class SessionVerifier:
    """A request's verifier over any transport, ``send(VerifyItem) -> VerifyOutcome``."""

    def __init__(self, send: Callable[[VerifyItem], Awaitable[VerifyOutcome]]):
        self.send = send
        self.window = Window()

    async def verify(self, state: RequestState, proposal: ProposeOutcome,
                     traceparent: str) -> VerifyOutcome:
        committed = state.committed

        def item(start: int) -> VerifyItem:
            return VerifyItem(state.session_id, len(committed), start, committed[start:],
                              list(proposal.draft_tokens), proposal.draft_probs, state.sampling,
                              state.request_id, traceparent, state.logprobs)

        return await call_with_resend(self.send, item, self.window, len(committed))
