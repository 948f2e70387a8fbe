"""zeroshard train: train a GPT preset or your own model (--model, --hf) on the standard
library's source or on your own data (--data), alone, as N local ranks, or inside torchrun.

With --nproc N (N > 1) it launches N local processes through torch.distributed.run (the elastic
launcher: a rank that dies makes the others stop at once); under an existing torchrun job it
joins it. Every value is checked before anything starts.

SIGINT or SIGTERM (Ctrl-C; torchrun forwards it to the ranks) makes every rank finish its step
(and save it in out_dir/ckpt with --save-every) and stop; one line says "interrupted at step S;
...". Exit status: 0 done, 1 failed, 2 bad input, 3 diverged (non-finite gradients, weights or
validation loss), 4 a collective timed out (--timeout; the line names the rank that did not arrive),
130 / 143 interrupted by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from zeroshard import checkpoint
from zeroshard.cli.main import UsageError
from zeroshard.data import BatchLoader
from zeroshard.divergence import Diverged
from zeroshard.mesh import launched_by_torchrun
from zeroshard.models.gpt import PRESETS
from zeroshard.models.loading import hf_context_len, import_factory, read_hf_config
from zeroshard.run_log import tensorboard_available
from zeroshard.signals import Stopped
from zeroshard.tokens import check_data_path, load_tokenizer
from zeroshard.train import TrainConfig, load_data, resume_path, save_config, train
from zeroshard.train_config import field_docs
from zeroshard.watchdog import CollectiveTimeout

# Errors that mean "the input is wrong" (exit 2) rather than "the run failed" (exit 1).
USER_ERRORS = (UsageError, ValueError, FileNotFoundError, PermissionError)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def presets_text() -> str:
    """One line per GPT preset: its parameter count and shape."""
    lines = ["GPT presets (--preset; byte vocabulary 256):"]
    for name, c in PRESETS.items():
        lines.append(
            f"  {name:<6} {_human(c.num_params()):>6} parameters: {c.n_layer} blocks x "
            f"{c.n_embd} wide, {c.n_head} heads, up to {c.block_size} tokens"
        )
    return "\n".join(lines)


_METAVARS = {
    "model": "PKG.MOD:FACTORY", "hf": "CONFIG.json", "wrap": "CLASS[,CLASS]", "data": "PATH",
    "tokenizer": "NAME", "out_dir": "DIR", "data_dir": "DIR", "resume": "PATH|auto",
}  # fmt: skip


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a GPT preset or your own model, on your own text or the standard library",
        description=__doc__,
        epilog=presets_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", type=Path, metavar="FILE", help="a TOML or JSON file of the fields below"
    )
    p.add_argument("--nproc", metavar="N", help="local processes to launch (default: 1)")
    p.add_argument(
        "--port", metavar="N", default="0", help="rendezvous port, 1-65535 (default: a free one)"
    )
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        choices = TrainConfig.CHOICES.get(f.name)
        text = docs.get(f.name, "")
        text += f" (default: {'none' if f.default is None else f.default}" + (
            f"; choices: {', '.join(map(str, choices))})" if choices else ")"
        )
        kind = {"int": "N", "float": "X"}.get(str(f.type)) or _METAVARS.get(f.name, "TEXT")
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else kind
        p.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, default=None, metavar=metavar,
            help=text.replace("%", "%%"),
        )  # fmt: skip
    return p


def _from_flag(name: str, text: str) -> Any:
    """A flag's string as its field's type; a UsageError naming the flag otherwise."""
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}[name]
    kind = str(field.type).split("|")[0].strip()
    try:
        if name == "timeout":
            return _seconds(text)
        return {"int": int, "float": float}.get(kind, str)(text)
    except ValueError:
        what = "an integer" if kind == "int" else "a number"
        flag = f"--{name.replace('_', '-')}"
        raise UsageError(
            f"{flag} {text!r}: {name} must be {what}, e.g. {flag} {field.default}"
        ) from None


_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def _seconds(text: str) -> float:
    """A duration flag: ``60``, ``60s``, ``5m`` or ``1h`` as seconds (ValueError otherwise)."""
    text = text.strip().lower()
    scale = _UNIT_S.get(text[-1:])
    return float(text[:-1]) * scale if scale else float(text)


def _int_flag(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not an integer; e.g. {flag} 2") from None


def load_config(path: Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """Fields from ``path`` (TOML or JSON), then non-None ``overrides`` (flag strings) on top."""
    values: dict[str, Any] = {}
    if path is not None:
        if not path.is_file():
            raise UsageError(f"config file {path} does not exist")
        try:
            if path.suffix == ".json":
                values = json.loads(path.read_text())
            else:
                try:
                    import tomllib
                except ModuleNotFoundError:  # Python 3.10
                    import tomli as tomllib
                values = tomllib.loads(path.read_text())
        except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            raise UsageError(f"config file {path} cannot be parsed: {exc}") from None
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(
                f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
    values.update({k: _from_flag(k, v) for k, v in overrides.items() if v is not None})
    return TrainConfig(**values)


def check_inputs(cfg: TrainConfig, nproc: int) -> None:
    """What ``TrainConfig`` cannot check alone (files, installed packages, rank count), before
    any process starts; a UsageError with the fix."""
    if cfg.batch_size % (nproc * cfg.grad_accum):
        raise UsageError(
            f"global batch {cfg.batch_size} does not divide across {nproc} ranks x "
            f"{cfg.grad_accum} micro-batches; use a --batch-size that is a multiple of "
            f"{nproc * cfg.grad_accum}"
        )
    if cfg.data:
        check_data_path(cfg.data)
    if cfg.tokenizer:
        load_tokenizer(cfg.tokenizer)
    if cfg.model:
        import_factory(cfg.model)
    if cfg.hf:
        context = hf_context_len(read_hf_config(cfg.hf))
        if context is not None and cfg.seq_len > context:
            raise UsageError(
                f"seq_len = {cfg.seq_len} exceeds the {context} positions of {cfg.hf}; pass "
                f"--seq-len {context} or less"
            )
    _check_batches(cfg, nproc)
    if cfg.log == "tensorboard" and not tensorboard_available():
        raise UsageError(
            "log = 'tensorboard' needs the tensorboard package, which is not installed; "
            "pip install tensorboard, or drop --log (metrics.jsonl is always written)"
        )


def _check_batches(cfg: TrainConfig, nproc: int) -> None:
    """The data gives every rank its batches and validation batches (as ``train`` cuts them)."""
    data = load_data(cfg)
    for tokens_N, num_eval in ((data.train, 0), (data.val, cfg.eval_batches)):
        loader = BatchLoader.from_global_batch(
            tokens_N, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len, world_size=nproc
        )
        if num_eval:
            loader.eval_batches(num_eval)


def _make_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"  # per process: every rank probes at once
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"cannot create output folder {out} ({exc.strerror}); pass a writable --out-dir"
        ) from None
    return out


def _check_port(port: int, *, bind: bool) -> None:
    """A TCP port number, and (``bind``: it will be used) free on this machine."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a TCP port; pass 1-65535, or 0 for a free one")
    if port == 0 or not bind:
        return
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UsageError(
                f"port {port} is already in use; pass another --port (or 0 for a free one)"
            ) from None


def run(args: argparse.Namespace) -> int:
    if launched_by_torchrun():
        return _run_rank(args)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    cfg = load_config(args.config, overrides)
    nproc = 1 if args.nproc is None else _int_flag("--nproc", args.nproc)
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    port = _int_flag("--port", args.port)
    _check_port(port, bind=nproc > 1)
    out = _make_out_dir(cfg.out_dir)
    check_inputs(cfg, nproc)
    cfg = _pin_resume(cfg)
    if nproc == 1:
        return _train_here(cfg, out)
    save_config(cfg, out / "config.json")
    return _launch(nproc, port, out / "config.json")


def _run_rank(args: argparse.Namespace) -> int:
    """One rank of a torchrun job: a bad input is reported once (rank 0 first) and exits 2."""
    try:
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
        cfg = load_config(args.config, overrides)
        return _train_here(cfg, _make_out_dir(cfg.out_dir))
    except USER_ERRORS as exc:
        _tear_down(clean=False)
        if _rank() != 0:  # rank 0 has most likely the same error: it reports first
            time.sleep(1.0)
        print(f"zeroshard train: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _train_here(cfg: TrainConfig, out: Path) -> int:
    """Train in this process (one rank of a torchrun job, or alone). Outcomes that every rank
    reaches together (done, interrupted, diverged) are reported by rank 0, then every rank
    tears the process group down after a barrier; anything else tears it down at once."""
    try:
        summary = train(cfg)
    except BaseException as exc:
        # The traceback's frames hold the model and optimizer, so the process groups: let go.
        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, Stopped):  # SIGINT/SIGTERM: every rank stopped at the same step
            return _finish(str(exc), exc.exit_code)
        if isinstance(exc, Diverged):  # agreed by every rank: see zeroshard.divergence
            return _finish(f"zeroshard train: {exc}", exc.exit_code, stream=sys.stderr)
        _tear_down(clean=False)
        if isinstance(exc, CollectiveTimeout):  # a peer stopped answering: this rank says so
            print(f"zeroshard train: error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C before train() installed its handlers
            if _rank() == 0:
                print("interrupted before training started; nothing saved", flush=True)
            return 130
        raise
    return _finish(
        f"done: {summary['model']} ({summary['num_params']:,} parameters), stage "
        f"{summary['stage']} {summary['precision']} on {summary['ranks']} rank(s), "
        f"{summary['steps']} steps ({summary['skipped_steps']} skipped) in "
        f"{summary['seconds']} s ({summary['tokens_per_s']:,} tokens/s); validation loss "
        f"{summary['val_loss_first']} -> {summary['val_loss_last']}; outputs in {out}",
        0,
    )


def _finish(line: str, code: int, stream: Any = None) -> int:
    if _rank() == 0:
        print(line, file=stream or sys.stdout, flush=True)
    _tear_down(clean=True)
    return code


def _pin_resume(cfg: TrainConfig) -> TrainConfig:
    """``--resume``: the checkpoint it names (``auto``: the newest), checked and printed."""
    path = resume_path(cfg)
    if path is None:
        return cfg
    found = checkpoint.info(path)  # FileNotFoundError when missing
    if not found.complete:
        raise UsageError(f"--resume {path}: {found.problem}")
    print(f"resuming from {path} (step {found.step})")
    return dataclasses.replace(cfg, resume=str(path))


def _tear_down(*, clean: bool) -> None:
    """Destroy the process groups before the interpreter exits: gloo's threads destroyed during
    interpreter teardown abort the process ("terminate called without an active exception").
    ``clean``: every rank got here, so a barrier first (no rank closes a connection that
    another still reads); else at once, the peers may be gone. Sub-groups go before the default
    group, whose store they use."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    # The model, optimizer and their pending works reach the groups through reference cycles:
    # freed now, while the groups are alive, not by the interpreter's final teardown.
    gc.collect()
    if clean:
        dist.barrier()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    dist.destroy_process_group()
    gc.collect()  # the last references to the destroyed groups, while the interpreter lives


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))  # a torchrun rank before its group exists


def _launch(nproc: int, port: int, config: Path) -> int:
    """``torchrun --nproc-per-node N -m zeroshard.cli.main train --config CONFIG``; the exit
    status is the ranks' (they reported bad input, divergence or an interrupt themselves)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # The agent's own reports of forwarded signals and failed ranks would follow ours.
    for name in ("multiprocessing.api", "agent.server.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").setLevel(logging.CRITICAL)
    rdzv = ["--standalone"] if not port else ["--master-port", str(port)]
    argv = [*rdzv, "--nproc-per-node", str(nproc), "-m", "zeroshard.cli.main"]
    argv += ["train", "--config", str(config)]
    try:
        torchrun(argv)
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        if first.exitcode in (2, Diverged.exit_code, CollectiveTimeout.exit_code, 130, 143):
            return first.exitcode  # the ranks said why
        print(
            f"zeroshard train: rank {first.local_rank} failed (exit code {first.exitcode}); "
            f"the other ranks were stopped. {first.message or ''}".rstrip(),
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:  # forwarded to the ranks, which stopped and reported
        return 128 + int(exc.sigval)
    return 0
