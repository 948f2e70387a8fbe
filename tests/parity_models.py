"""Small models for the engine tests: tied embeddings, frozen layers, odd sizes."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard import wrap
from zeroshard.models.gpt import GPT, PRESETS, Block


class FrozenMLP(nn.Module):
    """Three linear layers; the first frozen, and the second's bias frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(13, 31), nn.Linear(31, 17), nn.Linear(17, 7)])
        self.layers[0].requires_grad_(False)
        self.layers[1].bias.requires_grad_(False)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class OddLayer(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)  # 7 * 11 = 77 and 11: odd sizes
        self.scale = nn.Parameter(torch.ones(n_out))
        self.empty = nn.Parameter(torch.empty(0))  # zero elements
        self.register_buffer("shift", torch.linspace(-1, 1, n_out))

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift


class OddModel(nn.Module):
    """Prime parameter counts, a one-element parameter, a zero-element one and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = OddLayer(7, 11)
        self.b = OddLayer(11, 3)  # 33 + 3 + 3 elements
        self.gain = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.gain


def build(kind: str) -> tuple[nn.Module, wrap.WrapPolicy | None]:
    """A freshly initialized model of ``kind`` (seed it before calling) and its wrap policy."""
    if kind == "gpt":
        return GPT(PRESETS["nano"]), wrap.by_class(Block)
    if kind == "frozen_mlp":
        return FrozenMLP(), wrap.by_class(nn.Linear)
    if kind == "odd":
        return OddModel(), wrap.by_class(OddLayer)
    if kind == "hf_gpt2":  # a real Hugging Face model, wrapped by its _no_split_modules
        import transformers

        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        return model, wrap.from_hf(model)
    if kind == "tiny_units":  # a 1-element unit: fewer elements than ranks
        model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Tanh(), nn.Linear(1, 2))
        return model, wrap.by_class(nn.Linear)
    raise ValueError(kind)


def batch(kind: str, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind in ("gpt", "hf_gpt2"):
        x = torch.randint(0, 256 if kind == "gpt" else 64, (global_batch, 16), generator=g)
        return x, torch.roll(x, -1, dims=1)
    n_in, n_out = {"frozen_mlp": (13, 7), "odd": (7, 3), "tiny_units": (1, 2)}[kind]
    return torch.randn(global_batch, n_in, generator=g), torch.randn(
        global_batch, n_out, generator=g
    )


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(x, y)
    if kind == "hf_gpt2":
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    return torch.nn.functional.mse_loss(model(x), y)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norms (tensors with fewer than 2 dims), as usual."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0},
    ]
