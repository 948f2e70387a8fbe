"""Small models for the engine tests: tied embeddings, frozen layers, odd sizes."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard import wrap
from zeroshard.models.gpt import GPT, PRESETS, Block, GPTConfig


class Cell(nn.Module):
    """One small unit (``width`` -> ``width``, 8 by default): the same-size units of the
    per-rank path tests."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class ResidualMlp(nn.Module):
    """``x + fc2(tanh(fc1(x)))``, ``width`` -> ``hidden`` -> ``width``: the blocks of the tests
    whose parameters are also read outside them (penalties, forces)."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


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


# ----------------------------------------------------------------------------- engine-use models
# Models whose forward uses units in unusual ways (tests/test_engine_use.py). Each is the nano GPT
# with another forward; its parameters (and so the initialization from a seed) are the nano GPT's.


class BlockTwiceGPT(GPT):
    """The nano GPT whose forward applies ``blocks[0]`` twice: a unit used twice per forward."""

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        T = idx_BT.shape[1]
        x_BTC = self.wte(idx_BT) + self.wpe(torch.arange(T, device=idx_BT.device))
        x_BTC = self.blocks[0](self.blocks[0](x_BTC))
        for block in self.blocks[1:]:
            x_BTC = block(x_BTC)
        logits_BTV = self.lm_head(self.ln_f(x_BTC))
        if targets_BT is None:
            return logits_BTV
        return nn.functional.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())


class CheckpointedBlock(Block):
    """A block whose attention and MLP are recomputed in backward (checkpoint inside a unit)."""

    use_reentrant = False

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        def attn(x):
            return self.attn(self.ln_1(x))

        def mlp(x):
            return self.mlp(self.ln_2(x))

        x_BTC = x_BTC + checkpoint(attn, x_BTC, use_reentrant=self.use_reentrant)
        return x_BTC + checkpoint(mlp, x_BTC, use_reentrant=self.use_reentrant)


class CheckpointedGPT(GPT):
    """The nano GPT with activation checkpointing ``where``:

    "inside"  inside each block (a unit): its attention and MLP are checkpointed separately
    "around"  around each block: ``checkpoint(block, x)``, the unit's hooks run inside it
    "pair"    around all blocks at once (two in the nano GPT): one checkpoint recomputes
              consecutive units

    ``use_reentrant`` picks torch's implementation; ``early_stop`` False runs the forward under
    ``set_checkpoint_early_stop(False)`` (non-reentrant: recompute the whole function).
    """

    def __init__(
        self, where: str, use_reentrant: bool, early_stop: bool = True, cfg: GPTConfig | None = None
    ) -> None:
        super().__init__(cfg or PRESETS["nano"])
        if where not in ("inside", "around", "pair"):
            raise ValueError(where)
        self.where, self.use_reentrant, self.early_stop = where, use_reentrant, early_stop
        if where == "inside":
            for block in self.blocks:
                block.__class__ = CheckpointedBlock
                block.use_reentrant = use_reentrant

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        import contextlib

        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        early = contextlib.nullcontext() if self.early_stop else set_checkpoint_early_stop(False)
        with early:
            T = idx_BT.shape[1]
            x_BTC = self.wte(idx_BT) + self.wpe(torch.arange(T, device=idx_BT.device))
            if self.where == "inside":
                for block in self.blocks:
                    x_BTC = block(x_BTC)
            elif self.where == "around":
                for block in self.blocks:
                    x_BTC = checkpoint(block, x_BTC, use_reentrant=self.use_reentrant)
            else:

                def both(x):
                    for block in self.blocks:
                        x = block(x)
                    return x

                x_BTC = checkpoint(both, x_BTC, use_reentrant=self.use_reentrant)
            logits_BTV = self.lm_head(self.ln_f(x_BTC))
        if targets_BT is None:
            return logits_BTV
        return nn.functional.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())


class SkippingGPT(GPT):
    """The nano GPT with three blocks, of which ``skip`` (a set of block indices, changed by the
    caller between steps) are left out of the forward: the order of units changes."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=64))
        self.skip: set[int] = set()

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        T = idx_BT.shape[1]
        x_BTC = self.wte(idx_BT) + self.wpe(torch.arange(T, device=idx_BT.device))
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x_BTC = block(x_BTC)
        logits_BTV = self.lm_head(self.ln_f(x_BTC))
        if targets_BT is None:
            return logits_BTV
        return nn.functional.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())


def hf_t5():
    """A tiny real Hugging Face T5 (encoder-decoder, tied embeddings) and its wrap policy."""
    import transformers

    config = transformers.T5Config(
        d_model=16, d_ff=32, num_layers=2, num_heads=2, vocab_size=64, d_kv=8, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    return model, wrap.from_hf(model)


def train_gpt_both(model, ref, opt, ref_opt, steps: int, per_rank: int = 2) -> dict:
    """``steps`` GPT steps of a sharded model (this rank's rows) and its unsharded reference (the
    whole global batch): the largest loss difference and the final parameter difference."""
    import torch.distributed as dist

    import zeroshard

    rank, world = dist.get_rank(), dist.get_world_size()
    worst = 0.0
    for step in range(steps):
        x, y = batch("gpt", step, per_rank * world)
        mine = slice(per_rank * rank, per_rank * (rank + 1))
        loss = model(x[mine], y[mine])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst = max(worst, abs(total.item() / world - ref_loss.item()))
    with zeroshard.summon_full_params(model):
        pairs = zip(model.parameters(), ref.parameters())
        param = max((a - b).abs().max().item() for a, b in pairs)
    return {"loss": worst, "param": param}


def train_both(model, opt, ref, ref_opt, batches, loss_fn, mine) -> tuple[float, dict]:
    """Each batch's rows ``mine(x)`` through the sharded model, the whole ``x`` through its
    unsharded reference, each stepped: the largest difference of the full state from the
    reference's (in float64), and that full state."""
    import zeroshard

    for x in batches:
        opt.backward(loss_fn(model, mine(x)))
        opt.step()
        opt.zero_grad()
        loss_fn(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    diffs = ((full[k].double() - v.double()).abs().max() for k, v in ref.state_dict().items())
    return max(d.item() for d in diffs), full


def tp_parity(model, ref, opt, ref_opt, mesh, batches, loss_fn, clip: float = 0.0):
    """Train a tensor-parallel, sharded ``model`` and its unsplit reference ``ref`` alike: each
    data-parallel rank of ``mesh`` on its rows of every tensor of each global batch (tuples in
    ``batches``), ``ref`` on the whole batches, the loss ``loss_fn(model, *tensors)``, an
    optional gradient ``clip``. The largest difference of the global batch's loss, and the final
    parameter difference (split pieces gathered)."""
    import torch.distributed as dist

    from zeroshard import full_state_dict, tensor_parallel

    worst = 0.0
    for batch in batches:
        per = batch[0].shape[0] // mesh.world_size
        loss = loss_fn(model, *(t[per * mesh.rank : per * (mesh.rank + 1)] for t in batch))
        opt.backward(loss)
        if clip:
            opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref, *batch)
        ref_loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group)
        worst = max(worst, abs(total.item() / mesh.world_size - ref_loss.item()))
    full = full_state_dict(model, rank0_only=False)
    whole = tensor_parallel.gather_tensor_parallel(model, full, mesh.tp_group)
    param = max((whole[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return worst, param


def train_tp_both(
    cfg,
    *,
    stage: int,
    tp: int = 2,
    steps: int = 3,
    seq_len: int = 15,
    per_rank: int = 2,
    clip: float = 0.0,
    config=None,
    offload=None,
    sequence_parallel: bool = False,
) -> dict:
    """``steps`` AdamW steps of the GPT ``cfg`` split ``tp``-way (``zeroshard.tensor_parallel``)
    and ZeRO-sharded over the data-parallel ranks, each data-parallel rank on its rows of the
    global batch, against single-process training of the same model on the whole batch: the
    largest loss difference, the final parameter difference (pieces gathered), and the engine
    (for its ledger and checkpoint keeper)."""

    import zeroshard
    from zeroshard import tensor_parallel
    from zeroshard.models.gpt import GPT

    torch.manual_seed(0)
    ref = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(ref.state_dict())
    device_mesh, mesh = tensor_parallel.mesh_2d(tp)
    tensor_parallel.parallelize(model, device_mesh, sequence_parallel=sequence_parallel)
    model = zeroshard.shard(
        model, stage=stage, mesh=mesh, wrap=wrap.by_class(Block), config=config, offload=offload
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(7)
    shape = (per_rank * mesh.world_size, seq_len)
    xs = (torch.randint(0, cfg.vocab_size, shape, generator=gen) for _ in range(steps))
    batches = ((x, torch.roll(x, -1, dims=1)) for x in xs)
    worst, param = tp_parity(model, ref, opt, ref_opt, mesh, batches, lambda m, x, y: m(x, y), clip)
    return {"loss": worst, "param": param, "engine": zeroshard.engine_of(model), "model": model}
