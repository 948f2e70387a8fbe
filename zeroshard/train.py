"""The reference training loop behind ``zeroshard train``: a GPT on the standard library's source.

It uses only zeroshard's public API. Ways to run it:

    zeroshard train --preset tiny --steps 200                 # 1 process (CPU or one GPU)
    zeroshard train --nproc 2 --stage 3                       # 2 local ranks via torchrun (gloo)
    torchrun --nproc-per-node 8 -m zeroshard.cli.main train --stage 3 --preset 1b   # 8 GPUs, nccl
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m zeroshard.cli.main train --stage 3       # several nodes

Outputs in ``out_dir``: ``config.json``, ``metrics.jsonl`` (one JSON object per logged step and
evaluation) and ``loss.png``; with ``--save-every N`` checkpoints in ``out_dir/ckpt/step-NNNNNN``
(``zeroshard.checkpoint``), of which ``--keep K`` stay. ``--resume auto`` (or a checkpoint folder)
continues a run: the same batches, RNGs, loss scale and learning rates as if it had not stopped.
With ``--save-every``, SIGINT or SIGTERM makes every rank finish its step, save it in
``out_dir/ckpt`` and stop (``train`` raises ``Stopped``; ``zeroshard train`` exits with 130 / 143).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import zeroshard
from zeroshard import checkpoint
from zeroshard.data import BatchLoader, Corpus
from zeroshard.models.gpt import GPT, Block, preset
from zeroshard.signals import StopOnSignal, Stopped


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every knob of the reference run; CLI flags and config-file keys map one-to-one."""

    preset: str = "tiny"
    """GPT preset (zeroshard.models.gpt.PRESETS)."""
    stage: int = 3
    """ZeRO stage 0-3."""
    precision: str = "fp32"
    """fp32, tf32, bf16, fp16 or auto (BF16 where the device supports it, else FP32)."""
    checkpoint_every: int = 0
    """Activation checkpointing: spans of this many blocks keep only their input (0: off)."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 16
    """Global batch (sequences per step, summed over ranks); must divide by the rank count."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, then cosine decay to lr / 10)."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norms)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 0
    eval_every: int = 50
    """Steps between validation evaluations (and one at the end)."""
    eval_batches: int = 8
    """Global validation batches per evaluation."""
    log_every: int = 10
    out_dir: str = "runs/train"
    """Output folder (created if missing)."""
    data_dir: str | None = None
    """Corpus cache folder (default ~/.cache/zeroshard)."""
    save_every: int = 0
    """Steps between checkpoints in ``out_dir/ckpt`` (and one at the end); 0: no checkpoints."""
    keep: int = 3
    """Checkpoints kept in ``out_dir/ckpt`` (the oldest are removed)."""
    resume: str | None = None
    """A checkpoint folder to continue from, or "auto": the newest complete one in out_dir/ckpt."""

    def __post_init__(self) -> None:
        preset(self.preset)  # a ValueError listing the presets
        if self.save_every < 0 or self.keep < 1:
            raise ValueError(
                f"need save_every >= 0 and keep >= 1, got {self.save_every} and {self.keep}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.stage not in zeroshard.STAGES:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.precision not in ("fp32", "tf32", "bf16", "fp16", "auto"):
            raise ValueError(
                f"unknown precision {self.precision!r}; choose fp32, tf32, bf16, fp16 or auto"
            )
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of ``step``: linear warm-up then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def resume_path(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``cfg.resume`` names ("auto": the newest complete one in out_dir/ckpt)."""
    if not cfg.resume:
        return None
    if cfg.resume != "auto":
        return Path(cfg.resume)
    found = checkpoint.latest(Path(cfg.out_dir) / "ckpt")
    if found is None:
        raise FileNotFoundError(
            f"--resume auto found no complete checkpoint in {Path(cfg.out_dir) / 'ckpt'}; "
            "drop --resume to start afresh, or pass a checkpoint folder"
        )
    return found


def _records_until(path: Path, step: int) -> list[dict]:
    """The metrics of a run being resumed, up to and including ``step``."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if r["step"] <= step]


def rank_memory_bytes(device: torch.device) -> int:
    """This rank's memory now: allocated CUDA bytes, or the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def evaluate(model, batches, device) -> float:
    """Mean validation loss over ``batches`` (this rank's share), averaged over ranks."""
    model.eval()
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for x, y in batches:
            total += model(x.to(device), y.to(device)).float()
    model.train()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train), label="train") if train else None
    ax.plot(*zip(*val), marker="o", label="validation") if val else None
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(cfg: TrainConfig) -> dict:
    """Run the job described by ``cfg`` on the current torchrun job (or alone); returns the
    summary on every rank."""
    mesh = zeroshard.Mesh.from_env()
    rank, world, device = mesh.rank, mesh.world_size, mesh.device
    out = Path(cfg.out_dir)
    if cfg.batch_size % world:
        raise ValueError(
            f"global batch {cfg.batch_size} does not divide across {world} ranks; "
            f"use a multiple of {world}"
        )
    corpus = Corpus.build(cache_dir=cfg.data_dir)
    loader = BatchLoader.from_global_batch(
        corpus.train, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        rank=rank, world_size=world, seed=cfg.seed,
    )  # fmt: skip
    val_batches = BatchLoader.from_global_batch(
        corpus.val, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        rank=rank, world_size=world, seed=cfg.seed,
    ).eval_batches(cfg.eval_batches)  # fmt: skip

    torch.manual_seed(cfg.seed)
    model = GPT(preset(cfg.preset))
    num_params = sum(p.numel() for p in model.parameters())
    policy = zeroshard.precision.resolve(cfg.precision, device)
    model = zeroshard.shard(
        model, stage=cfg.stage, wrap=zeroshard.wrap.by_class(Block), mixed_precision=policy,
        config=zeroshard.ShardConfig(checkpoint_every=cfg.checkpoint_every),
    )  # fmt: skip
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = zeroshard.optimizer(
        model, torch.optim.AdamW, groups, lr=cfg.lr, betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
    )  # fmt: skip

    metrics_path = out / "metrics.jsonl"
    start, skipped, resume = 0, 0, resume_path(cfg)
    if resume is not None:
        extra = checkpoint.load(resume, model, opt)  # restores RNGs and the loss scale too
        start = int(extra.get("step", checkpoint.info(resume).step))
        skipped = int(extra.get("skipped", 0))
    records = _records_until(metrics_path, start) if start else []
    dist.barrier()  # every rank has read the old metrics before rank 0 rewrites them
    if rank == 0:
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def log(record: dict) -> None:
        records.append(record)
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    # With checkpoints on, SIGINT/SIGTERM stop the run after a save (in the main thread only).
    stopper = None
    if cfg.save_every and threading.current_thread() is threading.main_thread():
        stopper = StopOnSignal(device)
    with stopper or nullcontext():
        return _run(cfg, model, opt, loader, val_batches, records, log, stopper, start, skipped,
                    num_params=num_params, device=device)  # fmt: skip


def _run(cfg, model, opt, loader, val_batches, records, log, stopper, start, skipped, *,
         num_params: int, device: torch.device) -> dict:  # fmt: skip
    """``train``'s steps from ``start`` (a signal noted by ``stopper`` ends them with a save
    and ``Stopped``) and its summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(cfg.out_dir)
    bar = tqdm(
        total=cfg.steps, initial=start, disable=rank != 0, desc=f"stage {cfg.stage} x{world}"
    )
    if start and records and records[0]["kind"] == "eval":
        first_val = records[0]["val_loss"]
    else:
        first_val = evaluate(model, val_batches, device)
        log({"kind": "eval", "step": start, "val_loss": first_val})
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_start = t_log = time.perf_counter()
    batches = loader.iter(start_step=start, num_steps=max(0, cfg.steps - start))
    for step, (x, y) in enumerate(batches, start=start + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, cfg)
        loss = model(x.to(device), y.to(device))
        opt.backward(loss)
        norm = opt.clip_grad_norm(cfg.grad_clip) if cfg.grad_clip > 0 else None
        skipped += not opt.step()  # False when inf/NaN gradients made every rank skip it
        opt.zero_grad()
        if step % cfg.log_every == 0 or step == cfg.steps:
            mem = torch.tensor([rank_memory_bytes(device)], dtype=torch.float64, device=device)
            mems = [torch.zeros_like(mem) for _ in range(world)]
            dist.all_gather(mems, mem)
            now = time.perf_counter()
            tok_s = tokens_per_step * (step - (records[-1]["step"] if records else 0))
            tok_s /= max(now - t_log, 1e-9)
            t_log = now
            rec = {
                "kind": "train", "step": step, "loss": loss.item(), "lr": lr_at(step - 1, cfg),
                "grad_norm": None if norm is None else norm.item(), "tokens_per_s": tok_s,
                "rank_mem_mib": [round(m.item() / 2**20, 1) for m in mems],
            }  # fmt: skip
            log(rec)
            bar.set_postfix(
                loss=f"{rec['loss']:.3f}", tok_s=f"{tok_s:,.0f}",
                mem_mib="/".join(f"{m:.0f}" for m in rec["rank_mem_mib"]),
            )  # fmt: skip
        if step % cfg.eval_every == 0 or step == cfg.steps:
            log({"kind": "eval", "step": step, "val_loss": evaluate(model, val_batches, device)})
        due = cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps)
        signum = stopper.agreed() if stopper is not None else 0
        if due or signum:  # one save serves both
            where = checkpoint.step_path(out / "ckpt", step)
            state = {"step": step, "skipped": skipped}
            checkpoint.save(where, model, opt, state, keep=cfg.keep)
        if signum:
            bar.close()
            zeroshard.engine_of(model).wait_params()
            raise Stopped(signum, step, where)
        bar.update(1)
    bar.close()
    zeroshard.engine_of(model).wait_params()  # the last step's parameter refresh, if in flight
    elapsed = time.perf_counter() - t_start
    last_val = records[-1]["val_loss"]
    summary = {
        "preset": cfg.preset, "num_params": num_params, "stage": cfg.stage, "ranks": world,
        "precision": cfg.precision, "skipped_steps": skipped,
        "steps": cfg.steps, "seconds": round(elapsed, 1),
        "tokens_per_s": round(tokens_per_step * max(1, cfg.steps - start) / elapsed),
        "val_loss_first": round(first_val, 4), "val_loss_last": round(last_val, 4),
        "comm_bytes_per_step": sum(e.bytes for e in zeroshard.ledger(model).steps[-1].values()),
    }  # fmt: skip
    if rank == 0:
        plot(records, out / "loss.png")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def save_config(cfg: TrainConfig, path: Path) -> None:
    """Write ``cfg`` as JSON atomically (the torchrun workers read it back)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    os.replace(tmp, path)
