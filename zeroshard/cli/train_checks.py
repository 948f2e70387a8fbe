"""What ``zeroshard train`` checks before any process starts (``TrainConfig`` checks each value
alone): files and folders, installed packages, ports, the rank count, and whether the model can be
built at all. Each problem is a ``UsageError`` (exit 2) naming the value and the fix."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

from zeroshard.cli.main import UsageError
from zeroshard.data import BatchLoader
from zeroshard.models.gpt import PRESETS
from zeroshard.models.loading import hf_config, hf_context_len, import_factory, read_hf_config
from zeroshard.offload.folder import LockHeld, pid_lock, unusable_because
from zeroshard.residual_states.host_heap import memory_available_bytes
from zeroshard.run_log import tensorboard_problem
from zeroshard.tokens import check_data_path, load_tokenizer
from zeroshard.train import TrainConfig, load_data


def check_inputs(cfg: TrainConfig, nproc: int, local_ranks: int | None = None) -> None:
    """What ``TrainConfig`` cannot check alone (files, installed packages, rank count), before
    any process starts, for ``nproc`` ranks in all and ``local_ranks`` on this node (default:
    all of them); a UsageError with the fix."""
    check_divides(cfg, nproc)
    if cfg.data:
        check_data_path(cfg.data)
        _check_outside_data(cfg)
    if cfg.tokenizer:
        load_tokenizer(cfg.tokenizer)
    if cfg.model:
        import_factory(cfg.model)
    if cfg.hf:
        _say_weights_are_not_read(Path(cfg.hf))
        context = hf_context_len(read_hf_config(cfg.hf))
        hf_config(cfg.hf)  # transformers' own checks, here rather than on every rank
        if context is not None and cfg.seq_len > context:
            raise UsageError(
                f"seq_len = {cfg.seq_len} exceeds the {context} positions of {cfg.hf}; pass "
                f"--seq-len {context} or less"
            )
    _check_batches(cfg, nproc)
    _check_eager_build_fits(cfg, local_ranks or nproc)
    _check_states_fit(cfg, nproc, local_ranks or nproc)
    if cfg.offload_folder is not None:
        _check_offload_folder(cfg.offload_folder, Path(cfg.out_dir) / "ckpt")
    problem = tensorboard_problem() if cfg.log == "tensorboard" else None
    if problem:
        raise UsageError(
            f"log = 'tensorboard' {problem}, or drop --log (metrics.jsonl is always written)"
        )


def _say_weights_are_not_read(hf: Path) -> None:
    """``--hf`` builds from the config alone: a folder that holds weights (a pretrained model)
    trained from random ones without a word."""
    folder = hf if hf.is_dir() else hf.parent
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))
    if weights:
        warnings.warn(
            f"--hf builds the model from {folder}'s config with random weights; its "
            f"{weights[0].name} is not read: to fine-tune those weights, pass --model with a "
            "factory returning transformers.AutoModelForCausalLM.from_pretrained(folder)",
            stacklevel=2,
        )


def _check_eager_build_fits(cfg: TrainConfig, local_ranks: int) -> None:
    """A preset built in full on each of this node's ``local_ranks`` must fit in the memory
    available now (Linux's MemAvailable); beyond it only meta init (one unit at a time) can."""
    if cfg.meta_init or cfg.model or cfg.hf:
        return
    need = 4 * PRESETS[cfg.preset].num_params() * local_ranks  # FP32 weights, bytes
    available = memory_available_bytes()
    if available is not None and need > available:
        raise UsageError(
            f"preset {cfg.preset!r} built in full on {local_ranks} rank(s) takes "
            f"{need / 1e9:.1f} GB of FP32 weights, more than the {available / 1e9:.1f} GB of "
            "memory available; pass --meta-init true (each rank then initializes one unit at a "
            "time while sharding)"
        )


def _check_states_fit(cfg: TrainConfig, nproc: int, local_ranks: int) -> None:
    """Training on the CPU, a preset's model states (weights, gradients, AdamW's states: 16
    bytes per parameter in FP32, up to 20 in BF16 / FP16, as the stage partitions them) that
    stay in memory must fit in what this node has available, before launch: else the kernel
    kills a rank minutes later, which the others report as a failed collective."""
    import torch

    from zeroshard.offload import Tier
    from zeroshard.planner.memory import ENGINE_MIXED, PRECISION_BYTES, Placement, model_states

    if cfg.model or cfg.hf or torch.accelerator.is_available():
        return  # sizes known once built; an accelerator's memory is not the host's
    placement = Placement(  # (tier names: Placement takes them as they are)
        params=cfg.offload_params or Tier.DEVICE,
        grads=cfg.offload_gradients or Tier.DEVICE,
        optimizer_states=cfg.offload_optimizer or Tier.DEVICE,
    )
    states = model_states(
        PRESETS[cfg.preset].num_params(), stage=cfg.stage,
        num_dp_ranks=cfg.shard_group_size or nproc // cfg.tp,  # hybrid: partitioned over k
        num_mp_ranks=cfg.tp, placement=placement,
        bytes_per_param=PRECISION_BYTES.get(cfg.precision, (ENGINE_MIXED,))[0],  # auto: the more
    )  # fmt: skip
    need = local_ranks * sum(sum(v.values()) for t, v in states.items() if t is not Tier.NVME)
    available = memory_available_bytes()
    if available is not None and need > available:
        raise UsageError(
            f"preset {cfg.preset!r} at stage {cfg.stage} on {nproc} rank(s) keeps "
            f"{need / 1e9:.1f} GB of model states (weights, gradients, AdamW states) in this "
            f"node's memory, more than the {available / 1e9:.1f} GB available; use more nodes"
            f"{', a higher --stage' if cfg.stage < 3 else ''}, or put states on disk "
            "(--offload-optimizer nvme --offload-folder DIR; see zeroshard plan --offload)"
        )


def _check_outside_data(cfg: TrainConfig) -> None:
    """What the run writes (its --out-dir, its --offload-folder) is not inside a --data folder,
    whose every file is read as text: the run would train on its own config, metrics and
    checkpoints (a resume on other bytes than the run it continues)."""
    data = Path(cfg.data).resolve()
    if not data.is_dir():
        return
    for flag, path in (("--out-dir", cfg.out_dir), ("--offload-folder", cfg.offload_folder)):
        if path is not None and Path(path).resolve().is_relative_to(data):
            raise UsageError(
                f"{flag} {path} is inside --data {cfg.data}, whose files are all read as "
                "training data: the run would train on what it writes (config, metrics, "
                f"checkpoints); pass an {flag} outside it (e.g. {data.parent / 'runs'})"
            )


def _probe_writable(folder: Path) -> None:
    """Create ``folder`` and write a file in it (per process: every rank may probe at once);
    an OSError when it cannot."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".write-test-{os.getpid()}"
    probe.touch()
    probe.unlink()


def _check_offload_folder(path: str, checkpoints: Path) -> None:
    """The swap folder can be created and written (its space is checked by each rank's store
    against what it will hold, before step 1), outside the step folders that saves write
    into ``checkpoints`` and prune (a save found it there at its step and failed)."""
    folder, inside = Path(path).resolve(), checkpoints.resolve()
    if folder != inside and folder.is_relative_to(inside):
        raise UsageError(
            f"offload folder {path} is inside {checkpoints}, whose step folders the saves write "
            f"and prune; pass an --offload-folder outside it (e.g. {checkpoints.parent / 'swap'})"
        )
    try:
        _probe_writable(Path(path))
    except OSError as exc:
        raise UsageError(
            f"offload folder {path} is not writable ({unusable_because(exc)}); pass a "
            "writable --offload-folder on the fast disk"
        ) from None


def check_divides(cfg: TrainConfig, nproc: int) -> None:
    """``--tp`` divides the ``nproc`` ranks, and the global batch their data-parallel groups."""
    if nproc % cfg.tp:
        raise UsageError(
            f"--tp {cfg.tp} does not divide the {nproc} ranks; launch a multiple of {cfg.tp} "
            "(--nproc) or pick a --tp that divides it"
        )
    dp = nproc // cfg.tp  # data-parallel ranks: a tensor-parallel group shares its batch
    what = f"{dp} data-parallel ranks" if cfg.tp > 1 else f"{dp} ranks"
    if cfg.shard_group_size and dp % cfg.shard_group_size:
        raise UsageError(
            f"--shard-group-size {cfg.shard_group_size} does not divide the {what}; pass a "
            f"divisor of {dp} (the ranks of a node), or 0 to shard over every rank"
        )
    if cfg.batch_size % (dp * cfg.grad_accum):
        raise UsageError(
            f"global batch {cfg.batch_size} does not divide across {what} x "
            f"{cfg.grad_accum} micro-batches; use a --batch-size that is a multiple of "
            f"{dp * cfg.grad_accum}"
        )


def _check_batches(cfg: TrainConfig, nproc: int) -> None:
    """The data gives every rank its batches and validation batches (as ``train`` cuts them)."""
    data = load_data(cfg)
    for split, tokens_N, num_eval in (
        ("training", data.train, 0),
        ("validation", data.val, cfg.eval_batches),
    ):
        try:
            loader = BatchLoader.from_global_batch(
                tokens_N,
                global_batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
                world_size=nproc // cfg.tp,  # the data-parallel ranks
            )
            if num_eval:
                loader.eval_batches(num_eval)
        except ValueError as e:  # which split is too short: the loader knows only its tokens
            raise ValueError(f"the {split} split: {e}") from None


def make_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        _probe_writable(out)
    except OSError as exc:
        raise UsageError(
            f"cannot create output folder {out} ({unusable_because(exc)}); pass a writable "
            "--out-dir"
        ) from None
    return out


LOCK_NAME = ".zeroshard.lock"
"""In out_dir: flock'ed by the ``zeroshard train`` that writes there (holds its pid)."""
RUN_CONFIG_PREFIX = ".zeroshard-run-"
"""In out_dir: ``.zeroshard-run-HOST-PID.json``, the settings a launcher's ranks read (theirs
alone: a later command cannot rewrite them under them)."""
_LAUNCHER_FILES = re.compile(
    rf"{re.escape(LOCK_NAME)}|config\.json|{re.escape(RUN_CONFIG_PREFIX)}.*\.json"
)
"""What the launcher itself writes into out_dir before any rank trains."""


def run_config_path(out: Path, pid: int) -> Path:
    """The private settings file of launcher ``pid`` of this host in ``out``."""
    return out / f"{RUN_CONFIG_PREFIX}{socket.gethostname()}-{pid}.json"


def remove_dead_launchers_configs(out: Path) -> None:
    """Delete the private configs (``.zeroshard-run-HOST-PID.json``) that launchers of this
    host left when they were killed (their pid is gone); other hosts' are theirs to manage."""
    for path in out.glob(f"{RUN_CONFIG_PREFIX}{socket.gethostname()}-*.json"):
        pid = path.name[:-5].rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


@contextlib.contextmanager
def hold_out_dir(path: str, *, lock: bool) -> Iterator[Path]:
    """The output folder for the command's whole run: created (a UsageError when it cannot be)
    and, when ``lock`` (a single-node job), held against a second ``zeroshard train`` into it,
    which would rewrite the metrics, summary and checkpoints of this one and the settings its
    restarted ranks read. The kernel lets go of a lock whose process died. Folders this command
    created are removed again at the end, still held, when the run left nothing in them but
    the launcher's own files (refused input, a rank that failed before its first step). The
    nodes of a multi-node job share the folder: it is neither locked nor removed."""
    path = os.path.normpath(path)  # "new/../runs" names runs: "new" is neither made nor removed
    created = _make_folders(Path(os.path.abspath(path)))
    try:
        out = make_out_dir(path)
    except UsageError:
        for folder in created:  # the parents made before the folder itself failed
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    fd = lock_out_dir(out) if lock else None
    try:
        yield out
    finally:
        if fd is not None:
            try:
                if created:
                    _remove_if_unused(created)
                # Deleted while held: a command that opened it meanwhile sees it gone and
                # locks a new one (``pid_lock``).
                (out / LOCK_NAME).unlink(missing_ok=True)
            finally:
                os.close(fd)


def _make_folders(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; those this process created (not another that
    created one at the same moment), ``out`` first."""
    created = []
    for folder in [p for p in (out, *out.parents) if not p.exists()][::-1]:
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        except OSError:
            break  # make_out_dir names the problem
        created.append(folder)
    return created[::-1]


def lock_out_dir(out: Path) -> int:
    try:
        return pid_lock(out / LOCK_NAME, 0o644)
    except LockHeld as held:
        raise UsageError(
            f"--out-dir {out} is in use by another zeroshard train (pid {held.pid}); wait for "
            "it to end, or pass another --out-dir"
        ) from None


def _remove_if_unused(created: list[Path]) -> None:
    """Remove the output folder ``created[0]`` and the parents this command created, when it
    holds nothing but the launcher's files (the lock is held: no other command writes there)."""
    out = created[0]
    try:
        names = [p.name for p in out.iterdir()]
        if not all(_LAUNCHER_FILES.fullmatch(name) for name in names):
            return
        for name in names:
            (out / name).unlink(missing_ok=True)
        for folder in created:
            folder.rmdir()
    except OSError:
        pass  # a rank still writing, or the folder gone: leave it as it is


def check_port(port: int, *, bind: bool) -> None:
    """A TCP port number, and (``bind``: it will be used) free on this machine."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a TCP port; pass 1-65535, or 0 for a free one")
    if port == 0 or not bind:
        return
    with socket.socket() as s:
        try:
            # Every address, as torchrun's store binds it (one on 127.0.0.1 alone passed while
            # the port was taken on the host's own address: the store's traceback followed).
            s.bind(("", port))
        except OSError:
            raise UsageError(
                f"port {port} is already in use; pass another --port (or 0 for a free one)"
            ) from None


def open_files_needed(world: int) -> tuple[int, int]:
    """(least, wanted) files and sockets for a process of a ``world``-rank job: the launcher
    that hosts the job's store keeps a socket per rank and agent (at most 28 open at 2 ranks,
    30 at 4, measured on CLI runs here; a limit of 24 failed, 30 ran), a rank one per peer in
    each process group; ``wanted`` leaves room for checkpoint and offload files in flight."""
    return 26 + 2 * world, 256 + 4 * world


def raise_open_file_limit(world: int) -> None:
    """This process's soft open-file limit (``ulimit -n``), which the ranks inherit, raised
    towards what a ``world``-rank job wants where the hard limit allows: below its least,
    torch's store could not accept a rank's connection and every rank retried for its 300 s
    connect timeout, deaf to Ctrl-C, before a C++ traceback. A UsageError naming ``ulimit -n``
    where even the hard limit is below the least."""
    try:
        import resource
    except ImportError:  # (no such limits here)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    least, wanted = open_files_needed(world)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    if hard != resource.RLIM_INFINITY and hard < least:
        raise UsageError(
            f"the open-file limit (ulimit -n) is {soft}, at most {hard} for this shell: a run of "
            f"{world} rank(s) needs at least {least} files and sockets per process; raise it "
            f"(`ulimit -n {wanted}`; the hard limit, `ulimit -Hn`, is set by the administrator "
            "or /etc/security/limits.conf)"
        )
    cap = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
