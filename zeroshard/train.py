"""The reference training loop behind ``zeroshard train``: a GPT on the standard library's source,
or your own model (``--model``, ``--hf``) on your own data (``--data``).

It uses only zeroshard's public API. Ways to run it:

    zeroshard train --preset tiny --steps 200                 # 1 process (CPU or one GPU)
    zeroshard train --nproc 2 --stage 3                       # 2 local ranks via torchrun (gloo)
    torchrun --nproc-per-node 8 -m zeroshard.cli.main train --stage 3 --preset 1b   # 8 GPUs, nccl
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m zeroshard.cli.main train --stage 3       # several nodes

Outputs in ``out_dir``: ``config.json``, ``metrics.jsonl`` (one JSON object per logged step and
evaluation), ``loss.png`` and ``summary.json``; with ``--save-every N`` checkpoints in
``out_dir/ckpt/step-NNNNNN`` (``zeroshard.checkpoint``), of which ``--keep K`` stay.
``--resume auto`` (or a checkpoint folder) continues a run: the same batches, RNGs, loss scale and
learning rates as if it had not stopped.

How a run ends, on every rank at the same step: normally (``train`` returns the summary);
SIGINT or SIGTERM make every rank finish its step (and save it when checkpoints are on) and
raise ``Stopped``; divergence (``zeroshard.divergence``) raises ``Diverged``.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
import warnings
from contextlib import nullcontext, suppress
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard
from zeroshard import checkpoint, tensor_parallel
from zeroshard.data import BatchLoader, Corpus
from zeroshard.disk_traffic import DiskTraffic
from zeroshard.divergence import Diverged, DivergenceGuard
from zeroshard.models.loading import build_model, logits_of, read_hf_config
from zeroshard.precision import UnitPrecisionError
from zeroshard.run_log import MetricsLog, Progress, write_atomically
from zeroshard.schedule import lr_at as schedule_lr_at
from zeroshard.signals import StopOnSignal, Stopped
from zeroshard.stages import partition
from zeroshard.tokens import BYTE_VOCAB_SIZE, TokenData, load_tokens
from zeroshard.train_config import TrainConfig
from zeroshard.watchdog import diagnosed, same_steps_everywhere

__all__ = ["Diverged", "Stopped", "TrainConfig", "lr_at", "train"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): ``cfg.lr_schedule`` after a linear
    warm-up of ``cfg.warmup_steps`` (``zeroshard.schedule.lr_at``)."""
    return schedule_lr_at(step, peak_lr=cfg.lr, total_steps=cfg.steps,
                          warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule)  # fmt: skip


def resume_path(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``cfg.resume`` names ("auto": the newest complete one in out_dir/ckpt)."""
    if not cfg.resume:
        return None
    if cfg.resume != "auto":
        return Path(cfg.resume)
    found = checkpoint.latest(Path(cfg.out_dir) / "ckpt")
    if found is None:
        damaged = checkpoint.passed_over(Path(cfg.out_dir) / "ckpt")
        which = f" (damaged: {damaged[0].path}: {damaged[0].problem})" if damaged else ""
        raise FileNotFoundError(
            f"--resume auto found no complete checkpoint in {Path(cfg.out_dir) / 'ckpt'}"
            f"{which}; drop --resume to start afresh, or pass a checkpoint folder"
        )
    return found


def _records_until(path: Path, step: int) -> list[dict]:
    """The metrics of a run being resumed, up to and including ``step``; a last line cut short
    (the run was killed while writing it) is dropped."""
    lines = path.read_text().splitlines() if path.is_file() else []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            if number == len(lines):
                break
            raise ValueError(
                f"{path} line {number} is not a metrics record ({exc}); repair or remove it"
            ) from None
        for key in ("loss", "val_loss"):  # written as null when not finite (strict JSON)
            if key in record and record[key] is None:
                record[key] = float("nan")
        records.append(record)
    return [r for r in records if r.get("step", step + 1) <= step]


def load_data(cfg: TrainConfig) -> TokenData:
    """``cfg.data`` (``zeroshard.tokens``), else the standard library's source as bytes."""
    if cfg.data:
        return load_tokens(cfg.data, tokenizer=cfg.tokenizer)
    corpus = Corpus.build(cache_dir=cfg.data_dir)
    return TokenData(corpus.train, corpus.val, BYTE_VOCAB_SIZE, f"stdlib corpus {corpus.path}")


def _precision_name(asked: str, policy: object) -> str:
    """What ``asked`` ("auto" included) became: the preset name of ``policy``."""
    names = [n for n, p in zeroshard.precision.PRESETS.items() if p == policy]
    return f"{names[0]} (auto)" if asked == "auto" and names else asked


def rank_memory_bytes(device: torch.device) -> int:
    """This rank's memory now: bytes allocated on the accelerator, or the resident set on CPU."""
    if device.type != "cpu":
        return zeroshard.accelerator.memory_allocated_bytes(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def next_token_loss(model, x_BT: torch.Tensor, y_BT: torch.Tensor, vocab_size: int):
    """Mean cross-entropy (nats per token, FP32) of the model's logits against ``y_BT``."""
    return next_token_losses(model, x_BT, y_BT, vocab_size)[0]


def next_token_losses(
    model, x_BT: torch.Tensor, y_BT: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``next_token_loss``, and what the model adds to it in training (``auxiliary_loss``: a
    mixture of experts' router loss), or None."""
    try:
        output = model(x_BT)
        logits_BTV = logits_of(output, x_BT)
    except IndexError as exc:
        if "index out of range in self" not in str(exc):  # not an embedding's: a bug, shown
            raise
        t = x_BT.size(-1)
        raise ValueError(
            f"the model indexed past the end of a tensor, an embedding as a rule ({exc}), on "
            f"a batch of {t} positions whose largest token id is {int(x_BT.max())} (the data's "
            f"vocabulary "
            f"has {vocab_size} ids): give the model a vocabulary of at least {vocab_size} and "
            f"at least {t} positions (or lower --seq-len)"
        ) from exc
    if logits_BTV.size(-1) < vocab_size:
        raise ValueError(
            f"the model's logits have {logits_BTV.size(-1)} entries per token but the data has "
            f"{vocab_size} token ids; give the model a vocabulary of at least {vocab_size}"
        )
    loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())
    return loss, auxiliary_loss(model, output)


AUX_LOSS_COEFS = ("router_aux_loss_coef", "aux_loss_coef")
"""The names transformers' mixtures of experts give the weight of their router loss (JetMoE's
is the second), on the model or its config (a multimodal one's text config)."""


def auxiliary_loss(model, output) -> torch.Tensor | None:
    """What a Hugging Face mixture of experts (Mixtral, Qwen2-MoE, OLMoE, JetMoE, ...) adds to
    its loss when it is given labels: its ``AUX_LOSS_COEFS`` weight times its routers'
    load-balancing loss (the output's ``aux_loss``, made when the config sets
    ``output_router_logits``). The loss here is computed from the logits, without labels: the
    model's forward left it out. An ``aux_loss`` without a weight of a known name is a
    ValueError (left out, it trained without a word)."""
    aux = getattr(output, "aux_loss", None)
    if not isinstance(aux, torch.Tensor):
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for holder in (model, config, text):
        for name in AUX_LOSS_COEFS:
            coef = getattr(holder, name, None)
            if isinstance(coef, (int, float)):
                return coef * aux.float()
    raise ValueError(
        f"the model's output has an aux_loss (a router's load-balancing loss) but neither it nor "
        f"its config has a weight for it ({' or '.join(AUX_LOSS_COEFS)}), so training cannot add "
        "it as transformers would; set one, or turn the loss off (output_router_logits: false)"
    )


def evaluate(
    model, batches, device, *, num_chunks: int, vocab_size: int, stop=None
) -> float | None:
    """Mean validation loss over ``batches`` (this rank's share, each run as ``num_chunks``
    equal micro-batches, as training runs them), averaged over ranks; None when ``stop()`` (a
    collective: ``StopOnSignal.agreed``, asked before each batch) said to stop."""
    model.eval()
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for x, y in batches:
            if stop is not None and stop():  # (a long evaluation held a Ctrl-C until its end)
                model.train()
                return None
            for x_i, y_i in zip(x.chunk(num_chunks), y.chunk(num_chunks)):
                total += next_token_loss(model, x_i.to(device), y_i.to(device), vocab_size)
    model.train()
    with diagnosed("all_reduce", "the validation loss", None):
        dist.all_reduce(total)
    return total.item() / (len(batches) * num_chunks * dist.get_world_size())


def plot(records: list[dict], path: Path) -> None:
    # A Figure of its own, not pyplot's: train() called from a notebook left its backend
    # switched to Agg (``matplotlib.use``) and a figure in pyplot's registry.
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(*zip(*train), label="train") if train else None
    ax.plot(*zip(*val), marker="o", label="validation") if val else None
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")  # (a byte is a token of the built-in corpus)
    if train or val:  # (a run that failed before its first record has nothing to name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


_PER_NODE = {"out_dir", "data_dir", "data", "hf", "resume", "offload_folder", "log",
             "progress_every"}  # fmt: skip
"""Settings each node of a multi-node job may set its own way: its paths (each node's copy of
the data and of the ``--hf`` config, made absolute from its own folder: the models built from
them are compared at ``shard()``; its own disks), how it logs."""


def _reduces_every_micro_step(model) -> bool:
    """Whether the engine reduces a micro-batch's gradients at a backward that does not sync
    (partitioned gradients with ``reduce_every_micro_step``: the stage table says which)."""
    engine = zeroshard.engine_of(model)
    return engine.partition.gradients and engine.config.reduce_every_micro_step


def settings_differ(ours: dict, theirs: dict) -> list[str]:
    """The job settings (``asdict(TrainConfig)``) that differ, "name ours vs theirs"; the ones
    each node may set its own way (``_PER_NODE``) are left out."""
    return [
        f"{k} {ours.get(k)!r} vs {v!r}"
        for k, v in theirs.items()
        if k not in _PER_NODE and ours.get(k) != v
    ]


def _check_same_config(cfg: TrainConfig) -> None:
    """Every rank must train the same job: nodes launched with different settings would wait
    for each other in mismatched collectives until the timeout. A ValueError naming the
    settings that differ from rank 0's (one all-gather of the settings, at start)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {k: v for k, v in asdict(cfg).items() if k not in _PER_NODE}
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    with diagnosed("all_gather", "the settings", None):
        dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        differ = settings_differ(every[0], theirs)
        if differ:
            raise ValueError(
                f"rank {rank} was launched with other settings than rank 0 ({', '.join(differ)}); "
                "start every node with the same flags and config"
            )


def train(cfg: TrainConfig) -> dict:
    """Run the job described by ``cfg`` on the current torchrun job (or alone); returns the
    summary on every rank. Raises ``Stopped`` (SIGINT/SIGTERM) or ``Diverged`` on every rank."""
    mesh = zeroshard.Mesh.from_env(timeout_s=cfg.timeout)
    _check_same_config(cfg)
    if mesh.device.type == "cpu":
        mesh.share_cpu_threads()  # process-wide: this node's cores divided among its ranks
    device_mesh = None
    if cfg.tp > 1:  # a 2-D mesh: ZeRO and the data split over the data-parallel dim only
        device_mesh, mesh = tensor_parallel.mesh_2d(cfg.tp, mesh=mesh)
    rank, world, device = mesh.rank, mesh.world_size, mesh.device  # data-parallel
    first = dist.get_rank() == 0  # writes the outputs and speaks for every rank
    # SIGINT/SIGTERM only note the signal; every rank stops at the same step (main thread only).
    # A rank that cannot agree in time exits: at once (4 s) when there is nothing to save.
    in_main = threading.current_thread() is threading.main_thread()
    grace_s = StopOnSignal.GRACE_S if not cfg.save_every else StopOnSignal.GRACE_SAVING_S
    stopper = StopOnSignal(device, grace_s=grace_s, announce=first) if in_main else None
    with stopper or nullcontext():
        if cfg.batch_size % (world * cfg.grad_accum):
            raise ValueError(
                f"global batch {cfg.batch_size} does not divide across {world} ranks x "
                f"{cfg.grad_accum} micro-batches; use a multiple of {world * cfg.grad_accum}"
            )
        data = load_data(cfg)
        loader = BatchLoader.from_global_batch(
            data.train, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len,
            rank=rank, world_size=world, seed=cfg.seed,
        )  # fmt: skip
        val_batches = BatchLoader.from_global_batch(
            data.val, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len,
            rank=rank, world_size=world, seed=cfg.seed,
        ).eval_batches(cfg.eval_batches)  # fmt: skip

        torch.manual_seed(cfg.seed)
        built = build_model(
            preset_name=cfg.preset, model=cfg.model, hf=cfg.hf, wrap=cfg.wrap,
            vocab_size=data.vocab_size, meta_init=cfg.meta_init,
        )  # fmt: skip
        num_params = sum(p.numel() for p in built.module.parameters())
        if device_mesh is not None:
            tensor_parallel.parallelize(
                built.module, device_mesh, sequence_parallel=cfg.sequence_parallel
            )
        wrap = zeroshard.wrap.by_class(*built.unit_classes) if built.unit_classes else None
        if wrap is None:
            warnings.warn(
                f"{built.name} declares no _no_split_modules and no --wrap was given: the whole "
                "model is one unit (stage 3 gathers every parameter at once); pass --wrap "
                "ClassName (e.g. its transformer block)",
                stacklevel=2,
            )
        policy = zeroshard.precision.resolve(cfg.precision, device)
        fp32 = {c.strip(): "fp32" for c in (cfg.fp32_modules or "").split(",") if c.strip()}
        classes = sorted({type(m).__name__ for m in built.module.modules()})
        if any(c not in classes for c in fp32):
            missing = next(c for c in fp32 if c not in classes)
            raise ValueError(
                f"fp32_modules = {cfg.fp32_modules!r}: {built.name} has no {missing} module; "
                f"its classes: {', '.join(classes)}"
            )
        try:
            model = zeroshard.shard(
                built.module, stage=cfg.stage, wrap=wrap, mixed_precision=policy,
                unit_precision=fp32 or None,
                config=zeroshard.ShardConfig(
                    checkpoint_every=cfg.checkpoint_every,
                    partition_activations=cfg.partition_activations,
                    shard_group_size=cfg.shard_group_size,
                    reduce_every_micro_step=(
                        partition(cfg.stage).gradients and not cfg.accumulate_unreduced
                    ),
                ),
                param_init_fn=built.param_init_fn, offload=cfg.offload(), mesh=mesh,
            )  # fmt: skip
        except UnitPrecisionError as exc:  # (its advice is for shard's callers)
            raise ValueError(
                f"fp32_modules = {cfg.fp32_modules!r}: {'; '.join(exc.reasons)}. Such a module "
                "computes in the precision of the module that holds its weights: leave its "
                "class out of --fp32-modules, or name the class of its parent that reads them "
                "(tied weights are held by the whole model: --precision fp32)"
            ) from None
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = zeroshard.optimizer(
            model, torch.optim.AdamW, groups, lr=cfg.lr, betas=(0.9, 0.95),
            weight_decay=cfg.weight_decay, step_in_backward=cfg.step_in_backward,
        )  # fmt: skip

        out, fingerprint = Path(cfg.out_dir), data.fingerprint()
        start, skipped, resume = 0, (0, 0), resume_path(cfg)
        if resume is not None:
            extra = checkpoint.load(resume, model, opt)  # restores RNGs and the loss scale too
            opt.param_groups[0]["weight_decay"] = cfg.weight_decay  # not the saved run's
            start = int(extra.get("step", checkpoint.info(resume).step))
            skipped = (int(extra.get("skipped", 0)), int(extra.get("skipped_in_a_row", 0)))
            if first and extra.get("data", fingerprint) != fingerprint:  # (said, not refused)
                print(f"resuming on other data than the saved run's: {extra['data']} -> "
                      f"{fingerprint} ({data.source})", flush=True)  # fmt: skip
        records = _records_until(out / "metrics.jsonl", start) if start else []
        with diagnosed("barrier", "the start of training", None):
            dist.barrier()  # every rank has read the old metrics before rank 0 rewrites them
        log = MetricsLog(out, records, write=first, tensorboard=cfg.log == "tensorboard")
        engine = zeroshard.engine_of(model)
        num_units, hybrid = len(engine.units), engine.mesh.hybrid
        summary = {
            "model": built.name, "num_params": num_params, "num_units": num_units,
            "stage": cfg.stage, "ranks": dist.get_world_size(), "tp": cfg.tp,
            "shard_group_size": hybrid.shard_size if hybrid else 0,  # as the engine shards
            "precision": _precision_name(cfg.precision, policy),
            "grad_accum": cfg.grad_accum, "steps": cfg.steps, "data": data.source,
            "reduce_every_micro_batch": cfg.grad_accum > 1 and _reduces_every_micro_step(model),
            "vocab_size": data.vocab_size, "data_fingerprint": fingerprint,
        }  # fmt: skip
        try:
            with same_steps_everywhere():  # (a rank that ended early was killed or crashed)
                return _run(cfg, model, opt, loader, val_batches, log, stopper, start, skipped,
                            summary=summary, device=device)  # fmt: skip
        finally:
            log.close()


def _run(cfg, model, opt, loader, val_batches, log, stopper, start, skipped, *,
         summary: dict, device: torch.device) -> dict:  # fmt: skip
    """``train``'s steps from ``start`` and its summary (written by rank 0, also when the run
    diverges)."""
    # The --hf config as built, kept with each checkpoint: export and resume read it, not a file
    # edited since (it exported and resumed another model without a word).
    hf_config = json.dumps(read_hf_config(cfg.hf)) if cfg.hf else None
    rank, world = dist.get_rank(), dist.get_world_size()
    out, records, vocab = Path(cfg.out_dir), log.records, summary["vocab_size"]
    bar = Progress(
        total=cfg.steps, initial=start, desc=f"stage {cfg.stage} x{world}", enabled=rank == 0,
        every_s=cfg.progress_every,
    )  # fmt: skip
    guard = DivergenceGuard(
        opt, max_skipped_steps=cfg.max_skipped_steps, num_skipped=skipped[0],
        num_consecutive_skipped=skipped[1], num_taken=start - skipped[0],
    )  # fmt: skip
    disk = DiskTraffic(opt)
    if stopper is not None:
        stopper.training = True

    def evaluate_at(step: int) -> float | None:
        val = evaluate(model, val_batches, device, num_chunks=cfg.grad_accum, vocab_size=vocab,
                       stop=stopper.agreed if stopper is not None else None)  # fmt: skip
        if val is None:  # stopped: the step's save and Stopped follow (at the start: no step)
            if step == start:
                raise Stopped(stopper.agreed(), step, None, stopper.cause, started=False)
            return None
        log({"kind": "eval", "step": step, "val_loss": val})
        guard.check_validation(step, val)
        guard.check_masters(step)
        return val

    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_wall = time.perf_counter()
    done = start  # the last step completed
    try:
        if start and records and records[0]["kind"] == "eval":
            first_val = records[0]["val_loss"]
            evaluated = any(r["kind"] == "eval" and r["step"] == start for r in records)
            if start % cfg.eval_every == 0 and not evaluated:  # the stop cut it short
                evaluate_at(start)
        else:
            first_val = evaluate_at(start)
        # Training mode whatever the model came in (from_pretrained's are in eval mode): a
        # resume, whose first evaluation was done before, kept dropout off until the next.
        model.train()
        # Throughput is of training steps after the first: evaluations and saves move the
        # clocks on.
        t_start = t_log = time.perf_counter()
        batches = loader.iter(start_step=start, num_steps=max(0, cfg.steps - start))
        for step, (x, y) in enumerate(batches, start=start + 1):
            lr = lr_at(step - 1 - guard.num_skipped, cfg)  # (a skipped step does not move
            # the schedule on, as in DeepSpeed and Megatron: fp16's first overflows ate warm-up)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = _forward_backward(model, opt, x, y, cfg.grad_accum, device, vocab)
            norm = opt.clip_grad_norm(cfg.grad_clip) if cfg.grad_clip > 0 else None
            with diagnosed("all_reduce", "the loss", None):
                dist.all_reduce(loss)  # the global batch's loss, whatever the world size
            loss_value = loss.item() / dist.get_world_size()
            diverged = None
            try:
                guard.step(step, loss_value)  # skipped when some rank has inf/NaN gradients
            except Diverged as exc:  # skipped, as those before it: logged, then raised
                diverged = exc
            done = step
            opt.zero_grad()
            disk.collect()
            if step % cfg.log_every == 0 or step == cfg.steps or diverged:
                since = _steps_since(step, records, start)
                rec = _train_record(step, loss_value, lr, norm, since, t_log, tokens_per_step,
                                    device)  # fmt: skip
                rec |= disk.record(since, device)
                t_log = time.perf_counter()
                log(rec)
                bar.set_postfix(
                    loss=f"{loss_value:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                    mem_mib="/".join(f"{m:.0f}" for m in rec["rank_mem_mib"]),
                )  # fmt: skip
            if diverged:
                raise diverged
            paused = time.perf_counter()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                evaluate_at(step)
            due = cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps)
            signum = stopper.agreed() if stopper is not None else 0
            where = None
            if due or (signum and cfg.save_every):  # one save serves both
                where = checkpoint.step_path(out / "ckpt", step)
                state = {"step": step, "skipped": guard.num_skipped,
                         "skipped_in_a_row": guard.num_consecutive_skipped,
                         "settings": json.dumps(asdict(cfg)), "hf_config": hf_config,
                         "data": summary["data_fingerprint"]}  # fmt: skip
                checkpoint.save(where, model, opt, state, keep=cfg.keep)
                if not signum and stopper is not None:
                    # A signal during the save: this save is the stop's (it trained one more
                    # step and saved again, inside the ranks' grace period).
                    signum = stopper.agreed()
            paused = time.perf_counter() - paused
            t_start, t_log = t_start + paused, t_log + paused
            if step == start + 1 and cfg.steps > step:  # the first step allocates and warms
                t_start = time.perf_counter()  # up (cold after a resume): not throughput
            if signum and step < cfg.steps:  # at the last step the run is done: it ends as such
                raise Stopped(signum, step, where, stopper.cause)
            bar.update(1)
    except BaseException as exc:
        # The folder says how the run ended, also when it did not finish: its status, the
        # error's line, and the last step completed (updated, or skipped for inf/NaN).
        status = next((s for t, s in _ENDINGS if isinstance(exc, t)), "failed")
        summary.update(status=status, error=_first_line(exc), skipped_steps=guard.num_skipped,
                       resumed_at_step=start, last_step=done)  # fmt: skip
        with suppress(Exception):  # never in place of the error being raised
            # (no plot when interrupted: matplotlib's import and drawing would delay the stop)
            _write_summary(summary, records, out, rank, losses=not isinstance(exc, Stopped))
        raise
    finally:
        bar.close()
    trained_s, elapsed = time.perf_counter() - t_start, time.perf_counter() - t_wall
    # The last evaluation done: the final step's, unless a signal cut it short (the run is
    # done all the same: the one before it, at an earlier step).
    last_eval = next(r for r in reversed(records) if r["kind"] == "eval")
    steps = zeroshard.ledger(model).steps
    last = steps[-1] if steps else {}  # none when a restart resumed the final checkpoint
    summary.update(
        status="done", skipped_steps=guard.num_skipped, resumed_at_step=start, last_step=done,
        seconds=round(elapsed, 1),
        tokens_per_s=round(tokens_per_step * max(1, cfg.steps - start - 1) / trained_s),
        val_loss_first=round(first_val, 4), val_loss_last=round(last_eval["val_loss"], 4),
        val_loss_last_step=last_eval["step"],
        comm_bytes_per_step=sum(e.bytes for e in last.values()),
        comm_bytes_per_step_by_label=_bytes_by_label(last),
        peak_rss_mib=[round(b / 2**20, 1) for b in _gather_ints(peak_rss_bytes(), device)],
    )  # fmt: skip
    if disk.offloaded:
        summary.update(disk.summary(records))
    _write_summary(summary, records, out, rank)
    return summary


def _forward_backward(model, opt, x_BT, y_BT, num_micro: int, device, vocab_size: int):
    """Forward and backward of this rank's batch as ``num_micro`` equal micro-batches; gradients
    are reduced once, by the last backward (the others run under ``no_sync``). Returns the mean
    cross-entropy (a detached scalar); what backward takes adds the model's auxiliary loss."""
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(zip(x_BT.chunk(num_micro), y_BT.chunk(num_micro))):
        loss, aux = next_token_losses(model, x.to(device), y.to(device), vocab_size)
        objective = loss if aux is None else loss + aux
        opt.backward(objective / num_micro, sync=i == num_micro - 1)
        total += loss.detach()
    return total / num_micro


def _train_record(step, loss, lr, norm, since, t_log, tokens_per_step, device) -> dict:
    """One ``metrics.jsonl`` training record, over the ``since`` steps trained since the clock
    ``t_log`` (gathers every rank's memory: a collective)."""
    mems = _gather_ints(rank_memory_bytes(device), device)
    tok_s = tokens_per_step * since / max(time.perf_counter() - t_log, 1e-9)
    return {
        "kind": "train", "step": step, "loss": loss, "lr": lr,
        "grad_norm": None if norm is None else norm.item(), "tokens_per_s": tok_s,
        "rank_mem_mib": [round(m / 2**20, 1) for m in mems],
        "time": round(time.time(), 3),  # Unix seconds: the gaps show restarts and stalls
    }  # fmt: skip


def _steps_since(step: int, records: list[dict], start: int) -> int:
    """Steps trained by this process since the last training record (or since it started at
    ``start``: a resumed run's earlier records were trained by another)."""
    last = next((r["step"] for r in reversed(records) if r["kind"] == "train"), None)
    return step - max(start, last if last is not None else 0)


def peak_rss_bytes() -> int:
    """The most resident memory this process has had (``ru_maxrss``), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gather_ints(value: int, device: torch.device) -> list[int]:
    """``value`` of every rank, in rank order (a collective)."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    with diagnosed("all_gather", "the step counts", None):
        dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def _bytes_by_label(step: dict) -> dict[str, int]:
    """Bytes a step moved per ledger label ("params" gathers, "grads" reductions, ...)."""
    out: dict[str, int] = {}
    for (_, label), entry in step.items():
        out[label] = out.get(label, 0) + entry.bytes
    return out


_ENDINGS = ((Diverged, "diverged"), (Stopped, "interrupted"))
"""``summary.json``'s status of a run that one of these ended ("failed" for any other error)."""


def _first_line(exc: BaseException) -> str:
    """The line that says why the run ended: ours as printed, any other error with its type."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else ""
    if isinstance(exc, (Diverged, Stopped)):
        return line
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _write_summary(
    summary: dict, records: list[dict], out: Path, rank: int, *, losses: bool = True
) -> None:
    """Rank 0: ``summary.json``, then (``losses``) ``loss.png``."""
    if rank != 0:
        return
    write_atomically(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    if losses:
        plot(records, out / "loss.png")


def save_config(cfg: TrainConfig, path: Path) -> None:
    """Write ``cfg`` as JSON atomically (the torchrun workers read it back)."""
    write_atomically(path, json.dumps(asdict(cfg), indent=2) + "\n")
