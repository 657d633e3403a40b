"""A lean, static-KV-cache forward over a Hugging Face Llama checkpoint's own weights.

Used for the drafter, whose step cost decides whether speculation pays: the HF eager
forward of a 1 M-param model is dominated by per-call framework overhead (~3 ms here), this
one does ~12 tensor ops per layer on preallocated caches. The weights are the loaded
model's tensors (fused where that saves a call); nothing is re-trained or copied by hand.
Its logits match the HF forward to float tolerance (tested). The distribution a draft is
sampled from is computed from these logits, so q is exact whatever the tolerance.
"""

from __future__ import annotations

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


class LeanCache:
    """One sequence's preallocated KV cache; ``crop`` is the cache repair."""

    def __init__(self, model: LeanLlama):
        shape = (len(model.layers), model.n_kv, model.max_len, model.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * 4 * 2
