"""``zeroshard train --resume``: which checkpoint a run continues from, and what changed.

The launcher pins the checkpoint before any rank starts (``pin_resume``: ``auto`` is the newest
complete one of out_dir/ckpt; a fresh run into a folder of an earlier run's checkpoints, a roll
back that would mix two runs, or a folder of checkpoints given for one are refused, naming the
fix), says which settings differ from the saved run's (``say_changes``, with the learning rate
when the schedule moved), and a node joining a running elastic job is checked against that job.
Every start of the ranks under torchrun's agent resumes from the newest checkpoint
(``resume_after_restart``)."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path
from typing import Any

import torch

from zeroshard import checkpoint
from zeroshard.checkpoint_files import LEGACY_RUN, run_of
from zeroshard.cli.agent import Launch
from zeroshard.cli.main import UsageError
from zeroshard.models.loading import read_hf_config
from zeroshard.train import TrainConfig, lr_at, resume_path, settings_differ

_BOOKKEEPING = {"resume", "out_dir", "data_dir", "log_every", "eval_every", "eval_batches",
                "progress_every", "log", "timeout", "keep", "save_every"}  # fmt: skip
"""Settings that do not change what is trained: a resume may change them without a word."""


def saved_extra(resume: str) -> dict:
    """The ``extra`` a checkpoint holds (rank 0's file: the step, skipped steps, settings), or
    {} when it cannot be read."""
    try:
        extra = torch.load(Path(resume) / "rank-00000.pt", weights_only=True, mmap=True)["extra"]
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, pickle.UnpicklingError):
        return {}
    return extra if isinstance(extra, dict) else {}


def saved_settings(saved: Path, resume: str | None, *, quiet: bool = False) -> dict | None:
    """The settings of the run that saved the checkpoint ``resume``: recorded in the checkpoint
    (rank 0's file), else (a checkpoint of an older version) the ``config.json`` beside it,
    ``saved`` (another run may have rewritten it since), else its own run folder's. An
    unreadable file is said on stdout unless ``quiet``."""
    if resume:
        try:
            return json.loads(saved_extra(resume)["settings"])
        except (KeyError, TypeError, ValueError):
            pass
        if not saved.is_file():  # resumed into another folder: the saved run's own
            saved = Path(resume).parent.parent / "config.json"  # RUN/ckpt/step-N -> RUN
    try:
        return json.loads(saved.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        if not quiet:
            print(f"(the saved run's settings in {saved} are unreadable, not compared: {exc})")
        return None


def say_changes(saved: Path, cfg: TrainConfig) -> None:
    """One line naming the settings of a resumed run that differ from those of the run that
    saved its checkpoint (``saved_settings``): allowed (a longer run, a new learning rate), but
    the curve then is not the one an uninterrupted run would have drawn. A schedule stretched
    or shortened by new ``steps`` changes the learning rate from the resumed step on: said with
    both rates."""
    before = saved_settings(saved, cfg.resume)
    if not isinstance(before, dict):
        return  # none saved: nothing to compare
    now = dataclasses.asdict(cfg)
    changed = [
        f"{k} {before[k]!r} -> {v!r}"
        for k, v in now.items()
        if k in before and k not in _BOOKKEEPING and before[k] != v
    ]
    extra = saved_extra(cfg.resume) if cfg.resume else {}
    kept = extra.get("hf_config")
    if cfg.hf and isinstance(kept, str):  # the file, edited since, builds another model
        edited = config_changes(kept, json.dumps(read_hf_config(cfg.hf)))
        how = "edited since the save" if before.get("hf") == cfg.hf else "another model's config"
        changed += [f"--hf {cfg.hf} {how} ({edited})"] if edited else []
    if not changed:
        return
    print(f"resuming with other settings than the saved run's: {', '.join(changed)}")
    step = checkpoint.info(cfg.resume).step if cfg.resume else None
    if step is None or not all(k in before for k in _SCHEDULE):
        return  # a saved config of another version: nothing sure to say
    applied = step - int(extra.get("skipped", 0))  # (skips do not move it)
    try:
        saved_rate = lr_at(applied, dataclasses.replace(cfg, **{k: before[k] for k in _SCHEDULE}))
    except (TypeError, ValueError):
        return
    rate = lr_at(applied, cfg)
    if not math.isclose(rate, saved_rate, rel_tol=1e-9):
        print(
            f"the learning rate of step {step + 1}, the first resumed, is {rate:.4g} "
            f"({cfg.lr_schedule} schedule over {cfg.steps} steps); the saved run's schedule "
            f"gave it {saved_rate:.4g}"
        )


def config_changes(kept: str, now: str) -> str:
    """The keys of two JSON configs whose values differ, "a 1 -> 2, ..."; "" when the same."""
    try:
        a, b = json.loads(kept), json.loads(now)
    except ValueError:
        return "" if kept == now else "its text"
    if not isinstance(a, dict) or not isinstance(b, dict):
        return "" if a == b else "its content"
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys)


_SCHEDULE = ("lr", "steps", "warmup_steps", "lr_schedule")
"""The settings ``lr_at`` reads."""


def _say_replaced(out: Path) -> None:
    """One line where a run that does not resume replaces the records of an earlier one that
    saved no checkpoint (nothing to refuse for: no run to continue), naming how it ended."""
    found = [name for name in ("metrics.jsonl", "summary.json") if (out / name).is_file()]
    if not found:
        return
    try:
        summary = json.loads((out / "summary.json").read_text())
        ended = f" (status {summary['status']} at step {summary['last_step']})"
    except (OSError, ValueError, KeyError, TypeError):
        ended = ""
    print(
        f"note: --out-dir {out} holds an earlier run's {' and '.join(found)}{ended} and no "
        "checkpoint: this run replaces them (pass another --out-dir to keep them)"
    )


def pin_resume(cfg: TrainConfig, launch: Launch) -> tuple[TrainConfig, bool]:
    """``--resume``: the checkpoint it names (``auto``: the newest), checked and printed. A run
    that does not resume must not start into a folder holding an earlier run's checkpoints:
    they would be pruned together, ``--resume auto`` would pick the other run, and (saving or
    not) it would rewrite that run's metrics, summary and config.json, which its resume and
    export read. A node
    joining an elastic job that runs already finds that job's checkpoints there: its ranks
    resume from the newest, as the running ones do (``resume_after_restart``); True then (its
    launcher leaves the job's config.json alone)."""
    path = resume_path(cfg)
    if path is None:
        earlier = checkpoint.latest(Path(cfg.out_dir) / "ckpt")
        if earlier is not None and launch.joins_running_job():
            _check_joins_the_same_job(cfg, launch)
            print(
                f"joining the job running at {launch.rdzv_endpoint}: its ranks resume from the "
                f"newest checkpoint in {earlier.parent}"
            )
            return cfg, True
        elif earlier is not None:
            raise UsageError(
                f"--out-dir {cfg.out_dir} holds checkpoints of an earlier run (newest: "
                f"{earlier.name}); pass --resume auto to continue it, or another --out-dir (or "
                f"delete {earlier.parent}) to start afresh"
            )
        if not launch.joins_running_job():  # (else they are the running job's)
            _say_replaced(Path(cfg.out_dir))
        return cfg, False
    if cfg.resume == "auto":  # a newer one that is damaged is not passed over without a word
        for other in checkpoint.passed_over(path.parent):
            print(f"--resume auto: passing over {other.path}, which is damaged: {other.problem}")
    found = checkpoint.info(path)  # FileNotFoundError when missing
    _check_not_a_folder_of_checkpoints(path, found)
    if not found.complete:
        raise UsageError(f"--resume {path}: {found.problem}")
    if found.step is not None and found.step >= cfg.steps:
        raise UsageError(
            f"--resume {path}: the checkpoint is at step {found.step} and --steps is "
            f"{cfg.steps}: nothing left to train; pass --steps above {found.step} to train on"
        )
    _check_no_later(cfg, path, found.step)
    if not launch.joins_running_job():  # (that job's folder: its metrics are the run's)
        _check_same_run(cfg, path)
    print(f"resuming from {path} (step {found.step})")
    return dataclasses.replace(cfg, resume=str(path)), False


def _check_not_a_folder_of_checkpoints(path: Path, found: Any) -> None:
    """``--resume`` given a run's output folder, or its ``ckpt`` folder, instead of one
    checkpoint: a UsageError naming the two ways to say it (it read "incomplete")."""
    if found.complete:
        return
    for folder, run in ((path / "ckpt", path), (path, path.parent)):
        newest = checkpoint.latest(folder)
        if newest is not None:
            raise UsageError(
                f"--resume {path} holds checkpoints but is not one: pass --resume {newest} "
                f"(its newest), or --resume auto --out-dir {run} to continue that run in its "
                "own folder"
            )


def _check_joins_the_same_job(cfg: TrainConfig, launch: Launch) -> None:
    """A node joining a running job must train that job: its ranks would stop every rank of
    it at the settings check (a bad input, which ends the job). Compared on this side, with
    the settings the job's first node wrote into out_dir/config.json."""
    try:
        job = json.loads((Path(cfg.out_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # none to compare with: the ranks' check remains
    differ = settings_differ(job, json.loads(json.dumps(dataclasses.asdict(cfg))))
    if differ:
        raise UsageError(
            f"the job running at {launch.rdzv_endpoint} was started with other settings "
            f"({', '.join(differ)}); join it with the same flags and config"
        )


def _check_no_later(cfg: TrainConfig, path: Path, step: int | None) -> None:
    """A run resumed from an earlier checkpoint than the newest of its out_dir (rolled back)
    would mix with the run it abandons: it rewrites metrics.jsonl from its step on (the
    abandoned run's later records gone, its later checkpoints kept), a restart or a later
    ``--resume auto`` would continue the abandoned run, and ``keep`` would prune the new one's
    checkpoints."""
    folder = Path(cfg.out_dir) / "ckpt"
    newest = checkpoint.latest(folder)
    if newest is None or step is None or (checkpoint.info(newest).step or 0) <= step:
        return
    raise UsageError(
        f"--resume {path}: {folder} holds later checkpoints of the run it rolls back (newest: "
        f"{newest.name}); training in the same --out-dir would rewrite that run's metrics from "
        f"step {step} on, and a restart or a later --resume auto would continue it: pass "
        f"another --out-dir for the new branch, or move the later checkpoints out of {folder} "
        f"(e.g. into {folder}-abandoned)"
    )


def _check_same_run(cfg: TrainConfig, path: Path) -> None:
    """A checkpoint resumed into an out_dir that holds another run's metrics would splice the
    two: that run's records up to the step kept before the resumed one's, its first validation
    loss in the summary, its curve in loss.png. The out_dir is the checkpoint's own run when
    the checkpoint lies in its ckpt folder or one of that folder's checkpoints has the same
    run id (a copy of it), or the folder's last run resumed from this very checkpoint (the same
    command again, after a failure before its first save); an out_dir without metrics.jsonl is
    a new one."""
    out = Path(cfg.out_dir)
    if not (out / "metrics.jsonl").exists():
        return
    folder = (out / "ckpt").resolve()
    if path.resolve().parent == folder:
        return
    run = run_of(path)
    own = folder.glob("step-*") if folder.is_dir() else ()
    if run is not None and run != LEGACY_RUN and any(run_of(c) == run for c in own):
        return
    try:
        last = json.loads((out / "config.json").read_text()).get("resume")
    except (OSError, ValueError, AttributeError):
        last = None
    if last and Path(last).resolve() == path.resolve():
        return
    own_run = (
        f"its own run's folder ({path.parent.parent}) or " if path.parent.name == "ckpt" else ""
    )
    raise UsageError(
        f"--resume {path}: --out-dir {cfg.out_dir} holds another run's metrics.jsonl, which "
        "the resumed run would continue (its records, first validation loss and curve mixed "
        f"with this one's): pass {own_run}a new --out-dir"
    )


def resume_after_restart(cfg: TrainConfig, restart: int) -> tuple[TrainConfig, str | None]:
    """``cfg`` for restart number ``restart`` of the ranks (torchrun's agent restarted them after
    a failure; 0: started by an elastic agent, maybe anew as nodes joined or left): resumed from
    the newest complete checkpoint in out_dir/ckpt, which may have been saved at another world
    size, when it is later than the one ``cfg`` resumes from. Every rank of every node decides
    alike from the shared folder, whatever its launcher pinned: a node that joined late may
    have pinned a checkpoint pruned since. Also the line that says so (None: nothing to say)."""
    folder = Path(cfg.out_dir) / "ckpt"
    newest = checkpoint.latest(folder) if cfg.save_every else None
    step = checkpoint.info(newest).step if newest is not None else None
    pinned = None  # the step of the checkpoint cfg resumes from, while it still exists
    if cfg.resume and not restart and Path(cfg.resume).is_dir():
        pinned = checkpoint.info(cfg.resume).step
    if newest is not None and (pinned is None or (step or 0) > pinned):
        why = f"restart {restart}" if restart else "the job's nodes changed"
        return dataclasses.replace(cfg, resume=str(newest)), (
            f"{why}: resuming from {newest} (step {step})"
        )
    if not restart:
        return cfg, None
    start = f"from {cfg.resume}" if cfg.resume else "from step 0"
    why = f"no complete checkpoint in {folder} yet" if cfg.save_every else "save_every = 0"
    return cfg, f"restart {restart}: {why}; training again {start}"
