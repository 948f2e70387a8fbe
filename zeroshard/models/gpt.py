"""The reference GPT decoder: pre-LN blocks, causal attention, GELU MLP, tied embeddings.

Plain PyTorch. This file never imports the rest of zeroshard: ``zeroshard.shard`` distributes the
model afterwards, and parameter names stay as written here.

Shape legend: B batch, T sequence length, C embedding width (``n_embd``), H heads, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT; ``num_params()`` counts what it builds (tied embeddings counted once)."""

    n_layer: int
    """Number of transformer blocks (nl in the ZeRO papers)."""
    n_embd: int
    """Hidden width (hd)."""
    n_head: int
    """Attention heads; must divide ``n_embd``."""
    vocab_size: int = 256
    """Byte-level by default."""
    block_size: int = 256
    """Longest sequence the position embedding covers (tokens)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_head={self.n_head} must divide n_embd={self.n_embd}; "
                "pick a head count that divides the width"
            )

    def num_params(self) -> int:
        """Parameter count (elements) of ``GPT(self)``, computed without building it."""
        c, b = self.n_embd, int(self.bias)
        ln = c * (1 + b)
        block = 2 * ln + (c * 3 * c + 3 * c * b) + (c * c + c * b)
        block += (c * 4 * c + 4 * c * b) + (4 * c * c + c * b)
        return self.vocab_size * c + self.block_size * c + self.n_layer * block + ln

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    # ~36K: unit tests.
    "nano": GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=64),
    # ~0.84M: tests and quick runs.
    "tiny": GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=128),
    # ~4.9M: the CPU demo.
    "small": GPTConfig(n_layer=6, n_embd=256, n_head=8, block_size=256),
    # ~86M (GPT-2 small shape, byte vocabulary): GPU runs and planning.
    "100m": GPTConfig(n_layer=12, n_embd=768, n_head=12, block_size=1024),
    # ~1.2B: planning and multi-GPU runs.
    "1b": GPTConfig(n_layer=24, n_embd=2048, n_head=16, block_size=2048),
    # ~3.0B (48 GB of FP32 AdamW model states): ZeRO-Infinity on one machine
    # (examples/infinity.toml: built on the meta device, states on NVMe).
    "3b": GPTConfig(n_layer=26, n_embd=3072, n_head=24, block_size=2048),
}


def preset(name: str) -> GPTConfig:
    """The named preset; a ValueError lists the names when it does not exist."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        head_size = x_BTC.shape[-1] // self.n_head
        # Shapes from qkv's output: tensor-parallel ranks hold some heads only, and with sequence
        # parallelism x is this rank's part of the sequence, gathered by qkv.
        q, k, v = self.qkv(x_BTC).chunk(3, dim=2)
        B, T = q.shape[:2]
        # (B, T, h c) -> (B, h, T, c) for scaled_dot_product_attention.
        h = q.shape[-1] // head_size
        q, k, v = (t.view(B, T, h, head_size).transpose(1, 2) for t in (q, k, v))
        y_BhTc = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_BhTc.transpose(1, 2).reshape(B, T, h * head_size))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTC)))


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        return x_BTC + self.mlp(self.ln_2(x_BTC))


class GPT(nn.Module):
    """Decoder-only transformer; ``lm_head.weight`` is ``wte.weight`` (tied)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        # Where the residual stream starts (no parameters): sequence parallelism splits the
        # sequence here (zeroshard.tensor_parallel.gpt_plan).
        self.embed_out = nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def init_module(self, module: nn.Module) -> None:
        """Initialize ``module``'s own parameters in place, as ``__init__`` does (same
        distributions): for a model built on the meta device and materialized one module at a
        time, e.g. ``zeroshard.shard(model, param_init_fn=model.init_module)``."""
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        self._init_weights(module)
        residual = any(module is b.attn.proj or module is b.mlp.proj for b in self.blocks)
        if residual and isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        """Logits (B, T, V); with ``targets`` the mean cross-entropy (a scalar) instead."""
        B, T = idx_BT.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTC = self.embed_out(self.wte(idx_BT) + self.wpe(pos_T))
        for block in self.blocks:
            x_BTC = block(x_BTC)
        logits_BTV = self.lm_head(self.ln_f(x_BTC))
        if targets_BT is None:
            return logits_BTV
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
