"""``zeroshard train``: the reference GPT run, alone, as N local ranks, or inside torchrun.

With ``--nproc N`` (N > 1) it launches N local processes through ``torch.distributed.run`` (the
elastic launcher: a rank that dies makes the others stop at once); under an existing torchrun job
it simply joins it.

With ``--save-every``, SIGINT or SIGTERM (to this process: torchrun forwards it to the ranks)
makes every rank finish its step and save it in ``out_dir/ckpt``; rank 0 prints "saved step S to
PATH" and the command exits with 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from zeroshard import checkpoint
from zeroshard.cli.main import UsageError
from zeroshard.mesh import launched_by_torchrun
from zeroshard.signals import Stopped
from zeroshard.train import TrainConfig, resume_path, save_config, train


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train the reference GPT on the standard library's source",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="a TOML or JSON file of TrainConfig fields")
    p.add_argument("--nproc", type=int, help="local processes to launch (default 1)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float}.get(str(f.type), str)
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None)
    return p


def load_config(path: Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """Fields from ``path`` (TOML or JSON), then non-None ``overrides`` on top."""
    values: dict[str, Any] = {}
    if path is not None:
        if not path.is_file():
            raise UsageError(f"config file {path} does not exist")
        if path.suffix == ".json":
            values = json.loads(path.read_text())
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            values = tomllib.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(
                f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**values)


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


def _check_port(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UsageError(
                f"port {port} is already in use; pass another --port (or 0 for a free one)"
            ) from None


def run(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    cfg = load_config(args.config, overrides)
    nproc = 1 if args.nproc is None else args.nproc
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if cfg.batch_size % nproc:
        raise UsageError(
            f"global batch {cfg.batch_size} does not divide across {nproc} ranks; "
            f"use a --batch-size that is a multiple of {nproc}"
        )
    out = _make_out_dir(cfg.out_dir)
    cfg = _pin_resume(cfg)
    if launched_by_torchrun() or nproc == 1:
        return _train_here(cfg, out)
    if args.port:
        _check_port(args.port)
    save_config(cfg, out / "config.json")
    return _launch(nproc, args.port, out / "config.json")


def _train_here(cfg: TrainConfig, out: Path) -> int:
    """Train in this process (one rank of a torchrun job, or alone); rank 0 says how it ended."""
    summary, stop = None, None
    try:
        summary = train(cfg)
    except Stopped as exc:  # SIGINT/SIGTERM: every rank saved the step and stops
        stop = exc
    report = not launched_by_torchrun() or _is_rank0()
    _end_job()
    if stop is not None:
        if report:
            print(f"saved step {stop.step} to {stop.path}", flush=True)
        return stop.exit_code
    assert summary is not None
    if report:
        print(
            f"done: {summary['preset']} ({summary['num_params']:,} parameters), stage "
            f"{summary['stage']} {summary['precision']} on {summary['ranks']} rank(s), "
            f"{summary['steps']} steps ({summary['skipped_steps']} skipped) in "
            f"{summary['seconds']} s ({summary['tokens_per_s']:,} tokens/s); validation loss "
            f"{summary['val_loss_first']} -> {summary['val_loss_last']}; outputs in {out}"
        )
    return 0


def _pin_resume(cfg: TrainConfig) -> TrainConfig:
    """``--resume``: the checkpoint it names (``auto``: the newest), checked and printed."""
    path = resume_path(cfg)
    if path is None or launched_by_torchrun():
        return cfg  # under torchrun every rank resolves it in train()
    found = checkpoint.info(path)  # FileNotFoundError when missing
    if not found.complete:
        raise UsageError(f"--resume {path}: {found.problem}")
    print(f"resuming from {path} (step {found.step})")
    return dataclasses.replace(cfg, resume=str(path))


def _end_job() -> None:
    """Every rank done, then the process group torn down before the interpreter exits (gloo's
    threads destroyed during interpreter teardown can abort the process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _launch(nproc: int, port: int, config: Path) -> int:
    """``torchrun --nproc-per-node N -m zeroshard.cli.main train --config CONFIG``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    rdzv = ["--standalone"] if not port else ["--master-port", str(port)]
    argv = [*rdzv, "--nproc-per-node", str(nproc), "-m", "zeroshard.cli.main"]
    argv += ["train", "--config", str(config)]
    try:
        torchrun(argv)
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()))
        print(
            f"zeroshard train: rank {first.local_rank} failed (exit code {first.exitcode}); "
            f"the other ranks were stopped. {first.message or ''}".rstrip(),
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:  # forwarded to the ranks, which saved and stopped (or not)
        return 128 + int(exc.sigval)
    return 0
