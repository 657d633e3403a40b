"""A lean, static-KV-cache forward over a Hugging Face Llama checkpoint's own weights.

Used for the drafter, whose step cost decides whether speculation pays: the HF eager
forward of a 1 M-param model is dominated by per-call framework overhead (~3 ms here), this
one does ~12 tensor ops per layer on preallocated caches. The weights are the loaded
model's tensors (fused where that saves a call); nothing is re-trained or copied by hand.
Its logits match the HF forward to float tolerance (tested). The distribution a draft is
sampled from is computed from these logits, so q is exact whatever the tolerance.

``forward_batch`` feeds several sequences (each its own ``LeanCache``, its own length and
number of fed tokens) in one pass: the rows' tokens are packed one after another (no
padding), every linear/MLP matmul runs once for the batch, and attention is one SDPA call
per row and layer, against the row's own cache with its own causal mask, except for the
non-exact 1-token rows at contexts up to ``GATHER_MAX_CONTEXT``: they attend in one call over
their caches gathered into a padded, masked tensor (measured faster there; the gather copies
the whole context, so longer contexts loop). A single row is plain ``forward``.

Rows marked ``exact`` (sampled drafts) get logits bitwise independent of the batch: a
matmul's reduction order changes with its number of rows, so their single-token rows go
through one ``bmm`` with a row per batch entry (bitwise the 1-row matmul, whatever the
batch) and their multi-token rows through their own matmul; the other rows (greedy: argmax
needs no last bits) share one matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class UnsupportedModelError(ValueError):
    pass


@dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor  # [(h + 2 kvh) * d, H]
    wo: torch.Tensor
    ln2: torch.Tensor
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor


# Shared 1-token rows attend in one SDPA over their caches gathered into a padded tensor
# when the longest is at most this long (measured on CPU, bench drafter, 16 rows: 2.3x
# faster than a call per row at 64 tokens, 1.2x at 256, slower from ~600 on: the gather
# copies every row's whole context)
GATHER_MAX_CONTEXT = 512
_Group = tuple[int, int, bool]  # packed rows [a, b) of one matmul; True: a bmm row per token


@dataclass
class _Row:
    """One sequence of a batched forward: its cache, its tokens' packed span, its mask."""

    cache: LeanCache
    at: int  # first packed position
    t: int  # tokens fed
    start: int  # cache length before
    mask: torch.Tensor | None
    shared: bool  # not an exact row


def _pack(lens: Sequence[int], exact: Sequence[bool]) -> tuple[list[int], list[_Group], int]:
    """The packed order of the rows (shared 1-token rows, shared longer rows, exact 1-token
    rows, exact longer rows), the matmul groups over the packed tokens, and how many rows
    are shared."""
    n = len(lens)
    shared = [r for r in range(n) if not exact[r] and lens[r] == 1]
    shared += [r for r in range(n) if not exact[r] and lens[r] > 1]
    single = [r for r in range(n) if exact[r] and lens[r] == 1]
    own = [r for r in range(n) if exact[r] and lens[r] > 1]
    m_shared = sum(lens[r] for r in shared)
    groups: list[_Group] = []
    if shared:
        groups.append((0, m_shared, False))
    if single:
        groups.append((m_shared, m_shared + len(single), True))
    at = m_shared + len(single)
    for r in own:
        groups.append((at, at + lens[r], False))
        at += lens[r]
    return shared + single + own, groups, len(shared)


def _linear(x: torch.Tensor, w: torch.Tensor, groups: list[_Group]) -> torch.Tensor:
    """``F.linear`` per group of rows (see ``_pack``)."""
    if len(groups) == 1 and not groups[0][2]:
        return F.linear(x, w)
    out = x.new_empty(x.shape[0], w.shape[0])
    for a, b, rowwise in groups:
        if rowwise:
            out[a:b] = torch.bmm(x[a:b, None], w.T.expand(b - a, *w.T.shape))[:, 0]
        else:
            out[a:b] = F.linear(x[a:b], w)
    return out


class LeanLlama:
    """Shared weights; per-sequence state lives in ``LeanCache``."""

    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        if cfg.model_type not in ("llama",):
            raise UnsupportedModelError(f"lean forward supports llama, not {cfg.model_type}")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default" or cfg.hidden_act != "silu":
            raise UnsupportedModelError("lean forward needs default RoPE and SiLU")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise UnsupportedModelError("lean forward has no attention/MLP biases")
        m = model.model
        self.config = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = cfg.max_position_embeddings
        with torch.no_grad():
            self.embed = m.embed_tokens.weight.detach().float()
            self.norm = m.norm.weight.detach().float()
            self.lm_head = model.lm_head.weight.detach().float()
            self.layers = []
            for layer in m.layers:
                a, mlp = layer.self_attn, layer.mlp
                self.layers.append(_Layer(
                    ln1=layer.input_layernorm.weight.detach().float(),
                    wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).float(),
                    wo=a.o_proj.weight.detach().float(),
                    ln2=layer.post_attention_layernorm.weight.detach().float(),
                    w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float(),
                    w_down=mlp.down_proj.weight.detach().float(),
                ))
            theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
            inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
            freqs = torch.outer(torch.arange(self.max_len).float(), inv)
            emb = torch.cat([freqs, freqs], -1)
            self.cos, self.sin = emb.cos(), emb.sin()  # [max_len, d]

    def new_cache(self) -> LeanCache:
        return LeanCache(self)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, cache: LeanCache, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [T] at positions cache.length..; returns logits [T, V]."""
        t = tokens.shape[0]
        start = cache.length
        end = start + t
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the context ({self.max_len})")
        h, kvh, d = self.n_heads, self.n_kv, self.head_dim
        x = self.embed[tokens]  # [T, H]
        cos, sin = self.cos[start:end, None, :], self.sin[start:end, None, :]  # [T, 1, d]
        mask = None
        if t > 1:
            mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)
        for i, L in enumerate(self.layers):
            qkv = F.linear(self._rms(x, L.ln1), L.wqkv)  # [T, (h+2kvh) d]
            q, k, v = qkv.split([h * d, kvh * d, kvh * d], -1)
            q = self._rope(q.view(t, h, d), cos, sin)
            k = self._rope(k.view(t, kvh, d), cos, sin)
            cache.k[i, :, start:end] = k.transpose(0, 1)
            cache.v[i, :, start:end] = v.view(t, kvh, d).transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), cache.k[i, :, :end], cache.v[i, :, :end],
                attn_mask=mask, enable_gqa=h != kvh,
            )  # [h, T, d]
            x = x + F.linear(attn.transpose(0, 1).reshape(t, h * d), L.wo)
            gate, up = F.linear(self._rms(x, L.ln2), L.w_gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, L.w_down)
        cache.length = end
        return F.linear(self._rms(x, self.norm), self.lm_head)


    @torch.inference_mode()
    def forward_batch(self, caches: Sequence[LeanCache], tokens: Sequence[Sequence[int]],
                      exact: Sequence[bool] | None = None, last_only: bool = False
                      ) -> torch.Tensor:
        """Feed ``tokens[r]`` (>= 1 each) to ``caches[r]`` at its own positions, all rows in
        one pass. Returns logits [B, T_max, V] (right-padded with zeros past a row's tokens)
        or, with ``last_only``, each row's last token's [B, V]. ``exact[r]``: row r's
        logits are bitwise independent of the other rows (see the module docstring)."""
        n = len(caches)
        if len(tokens) != n or len({id(c) for c in caches}) != n:
            raise ValueError("forward_batch needs one token list per distinct cache")
        lens = [len(t) for t in tokens]
        for c, t in zip(caches, lens, strict=True):
            if t < 1:
                raise ValueError("every row of forward_batch feeds at least one token")
            if c.length + t > self.max_len:
                raise ValueError(f"sequence of {c.length + t} tokens exceeds the context "
                                 f"({self.max_len})")
        if n == 1:  # one sequence: ``forward`` (bitwise what an exact row gets in a batch)
            logits = self.forward(caches[0], torch.as_tensor(tokens[0], dtype=torch.long))
            return logits[-1:] if last_only else logits[None]
        order, groups, n_shared = _pack(lens, exact if exact is not None else [False] * n)
        rows, at = [], 0
        for j, r in enumerate(order):
            c, t = caches[r], lens[r]
            mask = torch.ones(t, c.length + t, dtype=torch.bool).tril(c.length) if t > 1 else None
            rows.append(_Row(c, at, t, c.length, mask, j < n_shared))
            at += t
        ids = torch.cat([torch.as_tensor(tokens[r], dtype=torch.long) for r in order])
        pos = torch.cat([torch.arange(w.start, w.start + w.t) for w in rows])
        x = self.embed[ids]  # [M, H], the rows' tokens one after another
        cos, sin = self.cos[pos, None, :], self.sin[pos, None, :]  # [M, 1, d]
        gather = self._gather_mask(rows)
        for i, L in enumerate(self.layers):
            x = self._layer_batch(i, L, x, cos, sin, rows, groups, gather)
        for w in rows:
            w.cache.length = w.start + w.t
        inverse = torch.empty(n, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(n)
        x = self._rms(x, self.norm)
        if last_only:
            return self._last_logits(x, rows, n_shared)[inverse]
        logits = _linear(x, self.lm_head, groups)
        out = logits.new_zeros(n, max(lens), logits.shape[-1])
        for r, w in zip(order, rows, strict=True):
            out[r, : w.t] = logits[w.at : w.at + w.t]
        return out

    def _last_logits(self, x: torch.Tensor, rows: list[_Row], n_shared: int) -> torch.Tensor:
        """Each packed row's last token's logits [B, V]: the shared rows' in one matmul, the
        exact 1-token rows' a bmm row each, an exact longer row's from its own matmul over
        all its tokens (as ``forward`` computes them, so bitwise the same)."""
        n_single = sum(1 for w in rows[n_shared:] if w.t == 1)
        head = rows[: n_shared + n_single]
        groups: list[_Group] = [(0, n_shared, False)] if n_shared else []
        if n_single:
            groups.append((n_shared, n_shared + n_single, True))
        parts = [_linear(x[torch.tensor([w.at + w.t - 1 for w in head])], self.lm_head,
                         groups)] if head else []
        parts += [F.linear(x[w.at : w.at + w.t], self.lm_head)[-1:] for w in rows[len(head):]]
        return torch.cat(parts)

    @staticmethod
    def _gather_mask(rows: list[_Row]) -> torch.Tensor | None:
        """The key mask [g, 1, 1, L] of the leading shared 1-token rows that attend together
        (None: every row attends on its own)."""
        g = 0
        while g < len(rows) and rows[g].t == 1 and rows[g].shared:
            g += 1
        ends = [w.start + 1 for w in rows[:g]]
        if g < 2 or max(ends) > GATHER_MAX_CONTEXT:
            return None
        mask = torch.arange(max(ends))[None, :] < torch.tensor(ends)[:, None]
        return mask[:, None, None, :]

    def _attend_gathered(self, i: int, q: torch.Tensor, rows: list[_Row],
                         mask: torch.Tensor) -> torch.Tensor:
        """1-token rows' attention [g, h, d] in one call over their padded caches."""
        n = mask.shape[-1]
        k = torch.stack([w.cache.k[i, :, :n] for w in rows])  # [g, kvh, n, d]
        v = torch.stack([w.cache.v[i, :, :n] for w in rows])
        return F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)[:, :, 0]

    def _layer_batch(self, i: int, L: _Layer, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, rows: list[_Row], groups: list[_Group],
                     gather: torch.Tensor | None) -> torch.Tensor:
        h, kvh, d = self.n_heads, self.n_kv, self.head_dim
        m = x.shape[0]
        qkv = _linear(self._rms(x, L.ln1), L.wqkv, groups)  # [M, (h+2kvh) d]
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], -1)
        q = self._rope(q.view(m, h, d), cos, sin)
        k = self._rope(k.view(m, kvh, d), cos, sin)
        v = v.view(m, kvh, d)
        attn = x.new_empty(m, h, d)
        for w in rows:  # the new keys and values into each row's own cache
            w.cache.k[i, :, w.start : w.start + w.t] = k[w.at : w.at + w.t].transpose(0, 1)
            w.cache.v[i, :, w.start : w.start + w.t] = v[w.at : w.at + w.t].transpose(0, 1)
        g = 0 if gather is None else gather.shape[0]
        if gather is not None:
            attn[:g] = self._attend_gathered(i, q[:g], rows[:g], gather)
        for w in rows[g:]:  # each row against its own cache, as ``forward`` does
            a, b, end = w.at, w.at + w.t, w.start + w.t
            attn[a:b] = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), w.cache.k[i, :, :end], w.cache.v[i, :, :end],
                attn_mask=w.mask, enable_gqa=h != kvh,
            ).transpose(0, 1)
        x = x + _linear(attn.view(m, h * d), L.wo, groups)
        gate, up = _linear(self._rms(x, L.ln2), L.w_gate_up, groups).chunk(2, -1)
        return x + _linear(F.silu(gate) * up, L.w_down, groups)


class LeanCache:
    """One sequence's preallocated KV cache; ``crop`` is the cache repair."""

    def __init__(self, model: LeanLlama):
        shape = (len(model.layers), model.n_kv, model.max_len, model.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def prefix_copy(self, length: int) -> LeanCache:
        """A new cache holding a copy of this one's first ``length`` entries (the rest zero,
        as in a new cache: batched attention reads padded positions under its mask)."""
        out = LeanCache.__new__(LeanCache)
        out.k, out.v = torch.zeros_like(self.k), torch.zeros_like(self.v)
        out.length = min(length, self.length)
        out.k[:, :, :out.length] = self.k[:, :, :out.length]
        out.v[:, :, :out.length] = self.v[:, :, :out.length]
        return out

    @property
    def nbytes(self) -> int:
        return self.k.numel() * 4 * 2
