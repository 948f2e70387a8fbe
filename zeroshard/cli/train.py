"""zeroshard train: train a GPT preset or your own model (--model, --hf) on the standard
library's source or on your own data (--data), alone, as N local ranks, or inside torchrun.

With --nproc N (N > 1) it launches N local processes through torch.distributed.run (the elastic
launcher: a rank that dies makes the others stop at once); under an existing torchrun job it
joins it. Every value is checked before anything starts.

With --max-restarts N (and --save-every) a failed rank makes the launcher restart every rank, up
to N times; each restart resumes from the newest complete checkpoint in out_dir/ckpt ("restart 1:
resuming from PATH (step S)"). --nnodes MIN:MAX --rdzv-endpoint HOST:PORT makes the job elastic
over nodes (c10d rendezvous): after a node leaves, the others restart and continue at the smaller
world size from the same checkpoint (it loads at any world size); a node started later with the
same command joins, and every rank resumes from the newest checkpoint. --rdzv-conf passes torchrun's
rendezvous settings, e.g. last_call_timeout=10 (the wait for more nodes once MIN are in, 30 s by
default) and keep_alive_interval=1 (how soon a node that left is noticed: 3 of them, 5 s each).

SIGINT or SIGTERM (Ctrl-C; torchrun forwards it to the ranks) makes every rank finish its step
(and save it in out_dir/ckpt with --save-every) and stop; one line says "interrupted at step S;
...". Exit status: 0 done, 1 failed, 2 bad input, 3 diverged (non-finite gradients, weights or
validation loss), 4 a collective timed out (--timeout; the line names the rank that did not arrive),
130 / 143 interrupted by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from zeroshard.cli.agent import LAUNCHER_PID, RESUME_NEWEST, Launch, run_agent
from zeroshard.cli.held_signals import held
from zeroshard.cli.main import UsageError, bad_input, unread_output_goes_quiet
from zeroshard.cli.resume import pin_resume, resume_after_restart, say_changes
from zeroshard.cli.run_files import put_back, run_files, trained_since
from zeroshard.cli.train_checks import (
    check_divides,
    check_inputs,
    check_port,
    hold_out_dir,
    lock_out_dir,
    make_out_dir,
    raise_open_file_limit,
    remove_dead_launchers_configs,
    run_config_path,
)
from zeroshard.divergence import Diverged
from zeroshard.mesh import launched_by_torchrun, tear_down
from zeroshard.models.gpt import PRESETS
from zeroshard.run_log import write_atomically
from zeroshard.signals import Stopped, before_giving_up
from zeroshard.train import TrainConfig, save_config, train
from zeroshard.train_config import field_docs
from zeroshard.watchdog import CollectiveTimeout, StartTimeout


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
    "offload_folder": "DIR", "fp32_modules": "CLASS[,CLASS]",
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
        "--port", metavar="N", default="0", help="rendezvous port, 1-65535 (default: 0, a free one)"
    )
    p.add_argument(
        "--max-restarts", metavar="N", default="0",
        help="times the launcher restarts every rank after one fails (torchrun's elastic agent); "
        "each restart resumes from the newest checkpoint in out_dir/ckpt, so it needs "
        "--save-every (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--nnodes", metavar="N|MIN:MAX",
        help="nodes of a multi-node job, each running this command with the same "
        "--rdzv-endpoint (c10d rendezvous); MIN:MAX is elastic: after a node leaves, the others "
        "continue at the smaller world size (needs --max-restarts) (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="with --nnodes: one node's address and a free port, the same on every node",
    )  # fmt: skip
    p.add_argument(
        "--rdzv-conf", metavar="KEY=N[,KEY=N]",
        help="with --nnodes: c10d rendezvous settings, whole numbers (torchrun's --rdzv-conf), "
        f"of {', '.join(RDZV_CONF)}; e.g. last_call_timeout=10 (seconds waited for more "
        "nodes once MIN joined, at the start and after a node leaves; default 30), "
        "keep_alive_interval=1 (a node that left is noticed after keep_alive_max_attempt of "
        "them; default 5 x 3)",
    )  # fmt: skip
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        choices = TrainConfig.CHOICES.get(f.name)
        text = docs.get(f.name, "")
        text += f" (default: {'none' if f.default is None else f.default}" + (
            f"; choices: {', '.join(map(str, choices))})" if choices else ")"
        )
        kind = {"int": "N", "float": "X", "bool": "{true,false}"}.get(str(f.type))
        kind = kind or _METAVARS.get(f.name, "TEXT")
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
        if kind == "bool":
            return _boolean(text)
        return {"int": int, "float": float}.get(kind, str)(text)
    except ValueError:
        what = {"int": "an integer", "bool": "true or false"}.get(kind, "a number")
        if name == "timeout":
            what = "seconds, or a number with s, m or h (60, 90s, 5m, 1h)"
        flag = f"--{name.replace('_', '-')}"
        raise UsageError(
            f"{flag} {text!r}: {name} must be {what}, e.g. {flag} {str(field.default).lower()}"
        ) from None


def _boolean(text: str) -> bool:
    """A yes/no flag: true/false, yes/no, on/off or 1/0 (ValueError otherwise)."""
    words = {"true": True, "yes": True, "on": True, "1": True}
    words |= {"false": False, "no": False, "off": False, "0": False}
    try:
        return words[text.strip().lower()]
    except KeyError:
        raise ValueError(text) from None


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
        if not path.exists():
            raise UsageError(f"config file {path} does not exist")
        if path.is_dir():
            raise UsageError(f"config file {path} is a folder; give the TOML or JSON file in it")
        text = path.read_text()  # once: a pipe (/dev/stdin, a shell's <(...)) reads as a file
        try:
            # (a pipe has no suffix to go by: JSON starts with a brace, no TOML document does)
            if path.suffix == ".json" or (path.suffix != ".toml" and text.lstrip()[:1] == "{"):
                values = json.loads(text)
            else:
                try:
                    import tomllib
                except ModuleNotFoundError:  # Python 3.10
                    import tomli as tomllib
                values = tomllib.loads(text)
        except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            raise UsageError(f"config file {path} cannot be parsed: {exc}") from None
        if not isinstance(values, dict):
            raise UsageError(
                f"config file {path} holds a {type(values).__name__}; it must hold an object of "
                'fields (e.g. {"steps": 100})'
            )
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(
                f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
    flags = {k: _from_flag(k, v) for k, v in overrides.items() if v is not None}
    if flags.keys() & _MODEL_SOURCES:  # one choice: a flag's replaces the file's other one
        values = {k: v for k, v in values.items() if k not in _MODEL_SOURCES}
    values.update(flags)
    return TrainConfig(**values)


def _check_not_launching(args: argparse.Namespace) -> None:
    """A rank of a job launched elsewhere (``RANK`` and ``MASTER_ADDR`` set, without
    torchrun's run id) asked to launch ranks itself: leftovers of another job in the shell
    made ``--nproc 2`` a rank of a job that does not exist (it waited out the timeout, then a
    traceback), or with ``RANK=0 WORLD_SIZE=1`` trained on one rank without a word."""
    launching = [f for f in ("nproc", "nnodes") if getattr(args, f, None) is not None]
    if launching and "TORCHELASTIC_RUN_ID" not in os.environ:
        env = ", ".join(f"{k}={os.environ[k]}" for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")
                        if k in os.environ)  # fmt: skip
        raise UsageError(
            f"--{launching[0]} asks zeroshard train to launch the ranks, but the environment "
            f"says this process is already one rank of a job launched elsewhere ({env}): "
            "unset RANK and MASTER_ADDR (left over from another job?), or launch each rank "
            f"yourself without --{launching[0]}"
        )


_MODEL_SOURCES = {"model", "hf", "preset"}
"""``TrainConfig`` fields that each name the model to train (the preset is used without)."""


def run(args: argparse.Namespace) -> int:
    with unread_output_goes_quiet():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if launched_by_torchrun():
        _check_not_launching(args)
        return _run_rank(args)
    with contextlib.ExitStack() as job:
        # The checks below read the data (seconds): a signal meanwhile ends the command with a
        # line.
        with held() as noted:
            launch, cfg, out, joining = _prepare(args, job)
        if noted:
            print("zeroshard train: interrupted before the ranks started", file=sys.stderr)
            return 128 + noted[0]
        return _launch(launch, cfg, out, job, joining=joining)


def _launch(
    launch: Launch, cfg: TrainConfig, out: Path, job: contextlib.ExitStack, *, joining: bool
) -> int:
    """Train as ``launch`` says, with ``out_dir/config.json`` recording the run (left alone by
    a node joining a running job: it is that job's). The ranks read their settings from a
    copy of their own beside it, which a later command cannot rewrite under them (every restart
    reads it again)."""
    saved = out / "config.json"
    previous = run_files(out)
    remove_dead_launchers_configs(out)
    if cfg.resume:
        say_changes(saved, cfg)
    if not joining:
        save_config(cfg, saved)
    started = time.time()
    refused = False  # bad input (exit 2) before any training: the folder's run is unchanged
    try:
        if not launch.elastic:  # (a signal's deadline ends this process without unwinding)
            with before_giving_up(job.close):
                code = _train_here(cfg, out)
        else:
            private = run_config_path(out, os.getpid())
            job.callback(private.unlink, missing_ok=True)
            save_config(cfg, private)
            code = run_agent(launch, private, on_failure=lambda r, c: _blame(out, r, c))
        refused = code == 2
        return code
    except Exception as exc:
        refused = bad_input(exc) is not None
        raise
    finally:
        if refused and not joining and not trained_since(out, started):
            put_back(out, previous)  # the folder's run is still the one it held, if any


def _blame(out: Path, rank: int, exit_code: int) -> None:
    """``summary.json`` of a run that a rank other than 0 ended by failing names that rank first:
    rank 0 wrote what it saw, most often its peer's disappearance (a CollectiveTimeout)."""
    path = out / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # rank 0 wrote none (it failed before training, or was the one that died)
    if rank == 0 or summary.get("status") != "failed":
        return
    summary["error"] = (
        f"rank {rank} failed first (exit code {exit_code}; its output says why); rank 0 then "
        f"saw: {summary.get('error')}"
    )
    write_atomically(path, json.dumps(summary, indent=2) + "\n")


def _prepare(
    args: argparse.Namespace, job: contextlib.ExitStack
) -> tuple[Launch, TrainConfig, Path, bool]:
    """The launch, the checked configuration (its resume pinned), the output folder, locked
    for ``job`` (single-node jobs: the nodes of a multi-node job share it), and whether this
    node joins a running elastic job."""
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    cfg = load_config(args.config, overrides)
    nproc = 1 if args.nproc is None else _int_flag("--nproc", args.nproc)
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    port = _int_flag("--port", args.port)
    launch = _launch_plan(args, cfg, nproc, port)
    check_port(port, bind=launch.elastic and not launch.rdzv_endpoint)
    out = job.enter_context(hold_out_dir(cfg.out_dir, lock=launch.max_nodes == 1))
    for world in launch.worlds()[1:]:  # the batch divides at every world size the job may have
        check_divides(cfg, world)
    check_inputs(cfg, launch.worlds()[0], local_ranks=launch.nproc)
    if launch.elastic:  # (one process trains alone without a store or peers to connect)
        raise_open_file_limit(launch.worlds()[-1])
    cfg, joining = pin_resume(cfg, launch)
    return launch, cfg, out, joining


def _launch_plan(args: argparse.Namespace, cfg: TrainConfig, nproc: int, port: int) -> Launch:
    """The launcher flags, checked: a UsageError naming the fix."""
    max_restarts = _int_flag("--max-restarts", args.max_restarts)
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts}: pass 0 or more restarts")
    if max_restarts and not cfg.save_every:
        raise UsageError(
            f"--max-restarts {max_restarts} without --save-every: a restart would train again "
            "from step 0; pass --save-every N (e.g. 100) so that it resumes from a checkpoint"
        )
    min_nodes = max_nodes = 1
    if args.nnodes is not None:
        try:
            low, _, high = args.nnodes.partition(":")
            min_nodes, max_nodes = int(low), int(high or low)
        except ValueError:
            min_nodes = 0
        if not 1 <= min_nodes <= max_nodes:
            raise UsageError(
                f"--nnodes {args.nnodes!r}: pass N or MIN:MAX nodes with 1 <= MIN <= MAX, "
                "e.g. --nnodes 2 or --nnodes 1:2"
            )
    if min_nodes < max_nodes and not max_restarts:
        raise UsageError(
            f"--nnodes {args.nnodes} is elastic, which needs --max-restarts N (with --save-every): "
            "after a node leaves, the others restart from the newest checkpoint; or pass "
            f"--nnodes {max_nodes}"
        )
    endpoint = args.rdzv_endpoint
    if endpoint is not None and max_nodes == 1:
        raise UsageError(  # (taken without a word: one node runs its own rendezvous)
            f"--rdzv-endpoint {endpoint}: only a multi-node job meets there; pass --nnodes N "
            "(or MIN:MAX) with it, or drop --rdzv-endpoint"
        )
    if max_nodes > 1 and not endpoint:
        raise UsageError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT: one node's address and a "
            "free port, the same on every node"
        )
    if endpoint is not None:
        host, _, endpoint_port = endpoint.rpartition(":")
        if not host or not endpoint_port.isdigit() or not 0 < int(endpoint_port) < 65536:
            raise UsageError(f"--rdzv-endpoint {endpoint!r}: pass HOST:PORT, e.g. 10.0.0.1:29500")
        if port:
            raise UsageError(
                f"--port {port} and --rdzv-endpoint {endpoint}: the rendezvous port is the one "
                "of --rdzv-endpoint; drop --port"
            )
    rdzv_conf = () if args.rdzv_conf is None else _rdzv_conf(args.rdzv_conf)
    if rdzv_conf and not endpoint:
        raise UsageError(
            f"--rdzv-conf {args.rdzv_conf}: only a multi-node job has a rendezvous to configure; "
            "pass --nnodes and --rdzv-endpoint, or drop --rdzv-conf"
        )
    return Launch(
        nproc=nproc, port=port, max_restarts=max_restarts, min_nodes=min_nodes,
        max_nodes=max_nodes, rdzv_endpoint=endpoint, rdzv_conf=rdzv_conf,
    )  # fmt: skip


RDZV_CONF = (
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt",
)  # fmt: skip
"""The settings of torchrun's c10d rendezvous that ``--rdzv-conf`` takes (positive integers)."""


def _rdzv_conf(text: str) -> tuple[tuple[str, int], ...]:
    """``--rdzv-conf KEY=N[,KEY=N]``, checked: a UsageError naming the fix."""
    pairs = []
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        if key not in RDZV_CONF:
            raise UsageError(
                f"--rdzv-conf {text!r}: unknown setting {key!r}; pass KEY=N[,KEY=N] with KEY one "
                f"of {', '.join(RDZV_CONF)}"
            )
        if not value.strip().isdigit() or int(value) < 1:
            raise UsageError(
                f"--rdzv-conf {text!r}: {key} must be a whole number of 1 or more, e.g. {key}=10"
            )
        pairs.append((key, int(value)))
    return tuple(pairs)


def _run_rank(args: argparse.Namespace) -> int:
    """One rank of a torchrun job: a bad input is reported once (by the first rank to meet
    it) and exits 2."""
    try:
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
        cfg = load_config(args.config, overrides)
        restart = _restart_count()
        # torchrun's agent restarted every rank after one failed, or (elastic jobs) started
        # them anew as nodes joined or left, which it does not count as a restart.
        if restart or os.environ.get(RESUME_NEWEST) == "1":
            cfg, line = resume_after_restart(cfg, restart)
            if line and _rank() == 0:
                print(line, flush=True)
        out = make_out_dir(cfg.out_dir)
        _hold_for_own_torchrun(out)
        return _train_here(cfg, out)
    except Exception as exc:
        line = bad_input(exc)  # bad input, or a disk full: a restart would only repeat it
        if line is None:
            raise
        first = _first_to_say(line)
        tear_down(clean=False)
        if first:
            print(f"zeroshard train: error: {line}", file=sys.stderr, flush=True)
        return 2


def _hold_for_own_torchrun(out: Path) -> None:
    """Local rank 0 of a single-node job launched by the user's own torchrun holds the output
    folder for its life, as ``zeroshard train``'s launcher does for its ranks (two such jobs
    into one folder interleaved their metrics and replaced each other's checkpoints). The
    kernel lets go of the lock when the process ends (a restarted rank takes it again)."""
    if LAUNCHER_PID in os.environ or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    if os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
        return  # several nodes share the folder (as the launcher leaves it unlocked)
    _HELD.append(lock_out_dir(out))


_HELD: list[int] = []
"""The output folder's lock held by this rank (``_hold_for_own_torchrun``), until exit."""


def _first_to_say(line: str, wait_s: float = 3.0) -> bool:
    """Whether this rank is the first of its job to report ``line``: every rank usually meets
    the same bad input, and the user should read it once. Decided by a counter in the job's
    store, keyed by the line and the restart, so a rank whose error differs still reports its
    own. The store is torchrun's agent's, which outlives the ranks; with ``--max-restarts``
    rank 0 hosts one per start, gone when rank 0 is, and none exists before the process group
    does: then rank 0 says it, and another rank only after ``PEER_SAYS_IT_S`` (``_after_rank_0``).
    True when no store answers within ``wait_s``: a line said twice is better than none."""
    import datetime
    import hashlib

    import torch.distributed as dist

    from zeroshard.watchdog import within

    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # the group's prefix: keys as seen before it
            store = store.underlying_store
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        try:  # bad input before the group exists: the agent's store, the group's to be
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=wait_s),
            )
        except (KeyError, ValueError, RuntimeError, OSError):  # no store: say it
            return True
    else:
        return _after_rank_0()
    digest = hashlib.sha1(line.encode()).hexdigest()[:16]
    key = f"zeroshard/said/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{_restart_count()}/{digest}"
    return within(lambda: store.add(key, 1), wait_s) in (None, 1)


PEER_SAYS_IT_S = 1.0
"""How long a rank other than 0 waits before it reports bad input that it cannot share through a
store: torchrun's agent looks at its ranks every 0.1 s, and stops them all once one has exited."""


def _after_rank_0() -> bool:
    """``_first_to_say`` without a store (a torchrun job that restarts, before its process group
    exists): True at once on rank 0; on another rank, True after ``PEER_SAYS_IT_S`` unless
    torchrun's agent stopped it meanwhile (rank 0 exited first: it said it for the job), then
    silently."""
    import signal
    import time

    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("RANK", "0") == "0":
        return True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's stop: no line of ours
    time.sleep(PEER_SAYS_IT_S)
    return True


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
        tear_down(clean=False)
        if isinstance(exc, (CollectiveTimeout, StartTimeout)):  # a peer stopped answering
            print(f"zeroshard train: error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C before train() installed its handlers
            if _rank() == 0:
                print("interrupted before training started; nothing saved", flush=True)
            return 130
        raise
    return _finish(
        f"done: {summary['model']} ({summary['num_params']:,} parameters), stage "
        f"{summary['stage']} {summary['precision']} on {_layout(summary)}, "
        f"{summary['steps']} steps ({summary['skipped_steps']} skipped) in "
        f"{summary['seconds']} s{_here(summary)} ({summary['tokens_per_s']:,} tokens/s training); "
        "validation loss "
        f"{summary['val_loss_first']} -> {summary['val_loss_last']}{_cut(summary)}; outputs in "
        f"{out}",
        0,
    )


def _cut(summary: dict) -> str:
    """Where the last validation loss was taken when a signal cut the final evaluation short."""
    at = summary.get("val_loss_last_step", summary["steps"])
    return "" if at == summary["steps"] else f" (at step {at}: a signal cut the last one short)"


def _layout(summary: dict) -> str:
    """``4 rank(s)``, `` (tp 2 x dp 2)`` for a tensor-parallel run (its 2-D mesh), and
    ``, sharded in groups of 2`` for a hybrid-sharded one."""
    ranks, tp, k = summary["ranks"], summary.get("tp") or 1, summary.get("shard_group_size")
    layout = f"{ranks} rank(s)" + (f" (tp {tp} x dp {ranks // tp})" if tp > 1 else "")
    return layout + (f", sharded in groups of {k}" if k else "")


def _here(summary: dict) -> str:
    """What the seconds of a resumed run's summary cover: the steps trained by this start."""
    start = summary.get("resumed_at_step") or 0
    return f" for steps {start + 1}-{summary['steps']}, resumed at step {start}" if start else ""


def _finish(line: str, code: int, stream: Any = None) -> int:
    if _rank() == 0:
        print(line, file=stream or sys.stdout, flush=True)
    tear_down(clean=True)
    return code


def _restart_count() -> int:
    """How many times torchrun's agent has restarted this job's ranks (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))  # a torchrun rank before its group exists
