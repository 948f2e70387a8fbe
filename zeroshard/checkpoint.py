"""Training checkpoints: model, optimizer, loss scaler, RNGs and your own state, saved atomically.

    zeroshard.checkpoint.save("out/ckpt/step-000100", model, opt, {"step": 100}, keep=3)
    extra = zeroshard.checkpoint.load("out/ckpt/step-000100", model, opt)   # {"step": 100}

Every rank of the model's group calls both (they are collectives). ``opt`` may be a list of the
model's optimizers (a GAN's two), saved and loaded in the same order. A checkpoint is one folder:

    .metadata, __<rank>_<i>.distcp   ``torch.distributed.checkpoint`` (DCP, FileSystemWriter) of
                                     ``{"model": model.state_dict(), "optim": opt.state_dict()}``:
                                     FSDP2's format, so it loads at any world size and stage, and
                                     FSDP2's ``get_state_dict`` / ``set_state_dict`` read it too.
    rank-<r>.pt                      rank r's own state, ``torch.save``-d: its RNGs (torch CPU,
                                     the accelerator's if initialized, numpy's global, python
                                     ``random``), the loss scaler's ``state_dict()`` and
                                     ``extra``.
    zeroshard.json                   written last, by rank 0: step, world size, stage, dtypes,
                                     parameter count, versions, and every other file's size in
                                     bytes and xxh3_64 checksum. A folder without it is incomplete.

``extra`` is a dict of your own values (tensors, numbers, strings, lists, tuples, dicts: it is
read back with ``torch.load(weights_only=True)``); a value with a ``state_dict()`` method (an LR
scheduler) is stored as that state dict. ``extra["step"]`` (an int) is the step recorded in the
metadata, and the data position: resume a ``BatchLoader`` with ``iter(start_step=step)``; without
it the optimizer's step count is recorded. ``load`` returns ``extra`` as saved (schedulers as
their state dicts: ``sched.load_state_dict(extra["sched"])``).

Safety. ``save`` first checks the free space of the target's file system against an estimate
(the bytes of every rank's state dict tensors, plus 5%). It writes into
``<path>.tmp-<random>`` (one random suffix, broadcast from rank 0), fsyncs every file and the
folder, waits for every rank, computes the checksums (each rank hashes a share of the files),
then rank 0 writes ``zeroshard.json`` and renames the folder to ``path``, fsyncing the parent. An
existing checkpoint at ``path`` is first renamed to ``<path>.old-<random>`` and removed only
after the new one is in place: a crash leaves either the old or the new checkpoint whole (or,
between the two renames, the old one under its ``.old-`` name, which ``load`` points to and
``latest`` returns). ``keep=K``: when ``path``'s name ends in digits (``step-000100``), complete
sibling checkpoints of the same prefix and run (``run_id``, named by a run's first save, taken
over by a load) beyond the newest K (by number) are removed, each renamed
to ``.gone-`` first (a removal cut short leaves no half checkpoint under a checkpoint's name),
and so are what earlier saves left when they stopped: ``.tmp-`` folders of saves that died
before their rename, ``.gone-`` folders, and ``.old-`` folders whose replacement is in place;
``keep=None`` keeps all.

``load`` compares the checkpoint's parameter names and shapes with the model's, then loads
through DCP (resharding to the current world size and stage) with the reader of
``zeroshard.checkpoint_reader``: each file read once, by several threads, straight into the
tensors loaded into, its checksum verified from the bytes as they are read (``verify=False``
skips it). A corrupt file therefore fails the load with a ``CheckpointError`` naming it after
part of the model may have been overwritten: load again from another checkpoint, which
overwrites every tensor. It then restores the loss scaler and the RNGs of rank ``r``'s file (of
rank ``r % saved_world_size`` when the world size changed: RNG streams do not reshard). Mistakes
are one-line ``CheckpointError`` (a ``ValueError``) or ``FileNotFoundError`` messages naming the
fix.

The folder must be on a file system every rank sees (one node, or a shared mount).

``save(..., async_save=True)`` returns a ``SaveHandle`` once this rank's state is snapshotted
to CPU memory; the files are written, hashed and published by a background thread (its
collectives on a separate gloo group of the same ranks). ``handle.wait()`` (or ``wait()``) returns
the path or raises the save's error; the next ``save`` or ``load`` waits for it first.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import checkpoint_async, rank_buffers, rng, tensor_parallel
from zeroshard import checkpoint_checks as checks
from zeroshard.checkpoint_async import SaveHandle  # noqa: F401 (re-exported)
from zeroshard.checkpoint_files import (
    LEGACY_RUN,
    META_FILE,
    TMP,
    CheckpointError,
    agree,
    broadcast,
    data_files,
    fsync_dir,
    fsync_file,
    gather,
    hash_share,
    prune,
    publish,
    replace_problem,
    without_zip_crc32,
)
from zeroshard.checkpoint_info import (  # noqa: F401 (the inspection API, re-exported)
    FORMAT_VERSION,
    CheckpointInfo,
    info,
    latest,
    passed_over,
    read_meta,
    step_path,
    verify,
)
from zeroshard.engine import engine_of
from zeroshard.state_dict_layout import tied_names, uncompiled
from zeroshard.watchdog import diagnosed, every_rank_calls

_WRITE_THREADS = 4  # DCP writer threads (a data file each) per rank: overlap encoding and I/O


def _optimizers(optimizer) -> list:
    """``optimizer``, or each of a list or tuple of them (several optimizers over one model);
    none for ``None`` or an empty list (a model that no optimizer trains: a teacher, an EMA)."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]


def _group(model, optimizer) -> dist.ProcessGroup | None:
    """The ranks a checkpoint of ``model`` is a collective of: the data-parallel group, or the
    whole job when the model is also split tensor-parallel (each rank holds parts of its own).
    A checkpoint is of a model and its optimizer(s) both."""
    if hasattr(model, "param_groups") and hasattr(optimizer, "forward"):
        raise TypeError(
            "the model comes first: save/load(path, model, optimizer), got an optimizer as the "
            "model and a module as the optimizer"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save/load(path, model, optimizer) take the sharded model, got {model!r}")
    for opt in _optimizers(optimizer):
        if getattr(opt, "engine", None) is not engine_of(model):
            raise TypeError(
                "a checkpoint holds a sharded model and its optimizer(s): pass the "
                f"zeroshard.optimizer(model, ...) of this model, a list of them, or None for "
                f"a model no optimizer trains (got {type(opt).__name__}); to read only the "
                "weights of a checkpoint with optimizer states, dcp.load({'model': sd}, "
                "checkpoint_id=PATH, planner=DefaultLoadPlanner(allow_partial_load=True)) "
                "then model.load_state_dict(sd)"
            )
    mesh = engine_of(model).mesh
    return None if mesh.tp_size > 1 else mesh.group


_EACH_RANK = "zeroshard.checkpoint: each rank writes and reads its own shards"

# --------------------------------------------------------------------- state


def _state(model, optimizer, *, saved: tuple | None = None) -> dict[str, Any]:
    """What a checkpoint holds, in FSDP2's structure: every sharded tensor as this rank's own
    range (``FlatRange``: views, no collective; DCP writes and reads them as chunks). Several
    optimizers' states are merged as ``get_state_dict(model, optimizers=[...])`` merges them:
    keyed by parameter name, their param groups one list, in order. Parameters without optimizer
    state (no step reached them yet) have none in it, unless it is a load's template (``saved``:
    what the checkpoint holds, ``checks.saved_optimizer``): then every parameter has its states
    and every entry the checkpoint holds is there to read into (``checks.optimizer_states``
    then drops what it does not hold)."""
    from zeroshard.optim_state_dict import optimizer_state_dict
    from zeroshard.state_dict import local_state_dict

    optim: dict[str, Any] = {"state": {}, "param_groups": []}
    for opt in _optimizers(optimizer):
        own = optimizer_state_dict(opt, local=True, template=saved is not None)
        if saved is not None:
            _add_saved_entries(opt, own, saved, len(optim["param_groups"]))
        shared = optim["state"].keys() & own["state"].keys()
        if shared:
            raise ValueError(
                f"two of the optimizers given both hold {sorted(shared)[0]!r}: pass each "
                "optimizer of the model once (a replaced optimizer no longer steps its "
                "parameters: leave it out)"
            )
        optim["state"] |= own["state"]
        optim["param_groups"] += own["param_groups"]
    state = {"model": local_state_dict(model), "optim": optim}
    mesh = engine_of(model).mesh
    tensor_parallel.place_pieces(model, state["optim"], mesh.tp_rank, mesh.tp_size)
    return state


def _add_saved_entries(opt, own: dict[str, Any], saved: tuple, first_group: int) -> None:
    """A load template of one optimizer (``own``) given the entries that the checkpoint holds
    and the optimizer keeps none of (saved with other hyperparameters: SGD's
    ``momentum_buffer``, Adam's ``max_exp_avg_sq``; a scheduler's ``initial_lr``): this rank's
    range of zeros for element-wise states (shaped as the saved parameter), a placeholder for
    the rest, so that the load reads them and the optimizer ends as the saved one, as torch's
    ``load_state_dict`` takes the saved groups and states whole. Its groups are the
    checkpoint's from ``first_group``."""
    from zeroshard.optim_state_dict import local_state_entries

    states, groups, shapes = saved
    held = {name for group in own["param_groups"] for name in group["params"]}  # (first names)
    local = local_state_entries(opt)
    for name, keys in states.items():
        for key, md in keys.items():
            if name not in held or key in own["state"].get(name, {}):
                continue
            size = getattr(md, "size", None)
            entry = None
            if size is not None and len(size) and tuple(size) == shapes.get(name):
                entry = local(name, key, md.properties.dtype)
            own["state"].setdefault(name, {})[key] = _placeholder(md) if entry is None else entry
    for j, group in enumerate(own["param_groups"]):
        for key, md in groups.get(first_group + j, {}).items():
            group.setdefault(key, _placeholder(md))


def _placeholder(md) -> torch.Tensor | None:
    """What a load reads a saved entry of storage metadata ``md`` into: a tensor of its size
    and dtype, or None for bytes (DCP puts the value read in its place)."""
    size = getattr(md, "size", None)
    return None if size is None else torch.empty(tuple(size), dtype=md.properties.dtype)


@contextlib.contextmanager
def _resident(model, optimizer) -> Iterator[None]:
    """The optimizer's states and the parameters' masters held in memory inside
    (``states_in_memory``, ``ParamSwapper.masters_in_memory``: no-ops unless they are offloaded
    to NVMe), streamed back out on exit (masters a load changed are written back)."""
    masters = getattr(engine_of(model), "param_swap", None)
    with contextlib.ExitStack() as stack:
        if masters is not None:
            stack.enter_context(masters.masters_in_memory())
        for opt in _optimizers(optimizer):
            stack.enter_context(getattr(opt, "states_in_memory", contextlib.nullcontext)())
        yield


def _optimizer_step(optimizer) -> int:
    """The (first) optimizer's step count: the steps it took (``steps_taken``: SGD keeps no
    count) or its states' count (Adam's "step", a loaded torch state's), whichever is larger
    (a parameter out of the loss on some steps counts fewer); 0 without an optimizer."""
    for opt in _optimizers(optimizer)[:1]:
        counts = [
            int(st["step"])
            for sub in getattr(opt, "sub_optimizers", [opt])
            for st in sub.state.values()
            if "step" in st
        ]
        return max([int(getattr(opt, "steps_taken", 0)), *counts])
    return 0


def _metadata(model, optimizer, step: int, world: int, token: str) -> dict[str, Any]:
    import zeroshard

    engine = engine_of(model)
    # A run's first save names it (``token``); a load (not model_only) continues a saved run.
    engine.run_id = engine.run_id or token
    param_dtypes = sorted({str(f.param_dtype).removeprefix("torch.") for f in engine.flat_params})
    reduce_dtypes = sorted({str(b.reduce_dtype).removeprefix("torch.") for b in engine.buckets})
    return {  # "tied": {alias: source} of what a model registers under several names
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world,
        "tensor_parallel": engine.mesh.tp_size,
        "stage": engine.stage,
        "param_dtype": ",".join(param_dtypes),
        "reduce_dtype": ",".join(reduce_dtypes),
        "num_params": tensor_parallel.whole_numel(model, engine.mesh.tp_size),
        "tied": tied_names(model),
        "run_id": engine.run_id,  # keep prunes this run's checkpoints only
        "optimizers": checks.class_names(_optimizers(optimizer)),
        "zeroshard_version": zeroshard.__version__,
        "torch_version": torch.__version__,
        "created_unix_s": round(time.time(), 3),
    }


# --------------------------------------------------------------------- save


def save(
    path: str | os.PathLike,
    model,
    optimizer,
    extra: dict | None = None,
    *,
    keep: int | None = 3,
    async_save: bool = False,
) -> Path | SaveHandle:
    """Save a checkpoint folder at ``path`` (see the module docstring); returns its path.

    A collective: every rank of the model's group calls it with the same ``path``.

    ``async_save=True`` returns a ``SaveHandle`` as soon as this rank's state is copied to CPU
    memory (a snapshot: training may go on and change the parameters); the writing, checksums
    and publishing go on in a background thread, whose collectives run on a separate gloo group
    (created by the first asynchronous save; every rank of the model's group takes part).
    ``handle.wait()`` returns the path, or raises the save's error. A later ``save`` or ``load``
    first waits for this process's save in flight (raising its error); call ``wait()`` (or the
    handle's) before the process exits.
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int or None (keep all), got {keep!r}")
    wait()  # the previous asynchronous save: published (or its error raised) first
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(
            f"extra is a dict of your own values to keep (e.g. {{'step': 100, 'scheduler': "
            f"sched}}), got {type(extra).__name__}; pass extra={{'step': ...}}"
        )
    extra = dict(extra or {})
    step = extra.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"extra['step'] is the step count, an int >= 0 (the metadata's step and the data "
            f"position to resume from); got {step!r}: pass int(step), or store your value "
            "under another key"
        )
    for key, value in extra.items():  # schedulers and other stateful objects: their state
        if callable(getattr(value, "state_dict", None)):
            extra[key] = value.state_dict()
    model = uncompiled(model)  # (a torch.compile wrapper: the model's own names)
    group = _group(model, optimizer)
    path = Path(path).expanduser().absolute()
    every_rank_calls("save", f"checkpoint {path.name}", _EACH_RANK, group)
    # A rank dying or stopping in the save: one line naming it, not the backend's from DCP.
    with diagnosed("save", f"checkpoint {path.name}", group):
        return _save(path, model, optimizer, extra, keep, async_save, group)


def _refuse_sparse_buffers(model: torch.nn.Module) -> None:
    """Every rank alike, before any exchange: torch.distributed.checkpoint writes strided
    tensors only ("Cannot access storage of SparseTensorImpl")."""
    buffers = rank_buffers.persistent_buffers(model)
    sparse = [name for name, b in buffers.items() if b.layout is not torch.strided]
    if sparse:
        raise CheckpointError(
            f"buffer {sparse[0]!r} is a sparse tensor ({buffers[sparse[0]].layout}), which "
            "checkpoints do not hold (torch.distributed.checkpoint writes strided tensors): "
            "register it with register_buffer(..., persistent=False) and build it again after "
            "a load, or keep it dense"
        )


def _save(
    path: Path, model, optimizer, extra: dict, keep: int | None, async_save: bool, group
) -> Path | SaveHandle:
    """``save`` once the arguments are checked (a collective on ``group``)."""
    engine_of(model).check_trusted()
    _refuse_sparse_buffers(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own = {
        "rank": rank,
        "world_size": world,
        "rng": rng.get_state(),  # first: nothing below may have drawn from them yet
        "loss_scaler": _loss_scalers(optimizer),
        "extra": extra,
        "buffers": rank_buffers.differing(model, group),  # e.g. BatchNorm's running statistics
    }
    own_bytes = checks.rank_file(own, extra)  # a snapshot of this rank's own state
    # One exchange: every rank sees every path and problem, so every rank raises alike.
    said = gather((str(path), replace_problem(path)), group)
    paths = [p for p, _ in said]
    if len(set(paths)) > 1:
        other = next(p for p in paths if p != paths[0])
        raise CheckpointError(
            f"the ranks passed different paths ({paths[0]} on rank 0, {other} on another): "
            "every rank saves to the same folder, on a file system they all see"
        )
    problem = next((e for _, e in said if e), None)
    if problem:
        raise CheckpointError(problem)
    _make_folder(path.parent, path, group)
    with _resident(model, optimizer):  # offloaded optimizer states: in memory until written/copied
        state = _state(model, optimizer)
        if rank:  # buffers the ranks hold apart: the model state's is rank 0's (full_state_dict's)
            state["model"] = {k: v for k, v in state["model"].items() if k not in own["buffers"]}
        step = int(extra.get("step", _optimizer_step(optimizer)))
        token = broadcast(secrets.token_hex(8), group)
        meta = _metadata(model, optimizer, step, world, token)
        checks.space(path.parent, checks.local_bytes(state), group)
        tmp = path.with_name(f"{path.name}{TMP}{meta['run_id'][:8]}{token[:4]}")
        _make_folder(tmp, path, group)
        job = (tmp, path, state, own_bytes, meta, keep)
        if not async_save:
            _write_and_publish(*job, group)
            return path
        copied = checkpoint_async.snapshot(state)  # copies, taken while resident
        job = (tmp, path, copied, *job[3:])
    return checkpoint_async.start(path, lambda g: _write_and_publish(*job, g), group)


def _make_folder(folder: Path, path: Path, group) -> None:
    """``mkdir -p folder`` on every rank, agreed: a rank that cannot (its own file system's
    permissions) stops every rank with its reason, instead of raising alone while the others
    wait for it in the next collective."""
    error = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        error = f"could not save checkpoint {path}: {exc}; save to a folder every rank can write"
    agree(error, group)


def _loss_scalers(optimizer) -> dict | list[dict]:
    """The loss scaler's state dict; with a list of optimizers, a list of them."""
    states = [opt.loss_scaler.state_dict() for opt in _optimizers(optimizer)]
    return states if optimizer is None or isinstance(optimizer, list | tuple) else states[0]


def wait() -> Path | None:
    """Wait for this process's asynchronous save in flight, if any: its path, or its error."""
    return checkpoint_async.wait()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_and_publish(
    tmp: Path, path: Path, state: dict, own: bytes, meta: dict, keep: int | None, group
) -> None:
    """Write the DCP files and this rank's file into ``tmp``, hash them, then rank 0 writes the
    metadata and publishes; a collective on ``group``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from zeroshard.checkpoint_planner import SavePlanner, Writer

    rank = dist.get_rank(group)
    error = None
    try:
        _write_bytes(tmp / f"rank-{rank:05d}.pt", own)
    except OSError as exc:
        error = f"could not write checkpoint {path}: {exc}"
    try:
        agree(error, group)  # every rank's own file is written
    except CheckpointError:
        if rank == 0:  # nothing else writes into it now
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    writer = Writer(tmp, sync_files=True, thread_count=_WRITE_THREADS)
    try:
        with without_zip_crc32():
            saved = dcp.save(
                state, storage_writer=writer, planner=SavePlanner(), process_group=group
            )  # (its Metadata, on every rank)
    except CheckpointException as exc:  # raised on every rank once any rank's write failed
        if rank == 0:  # every rank's writes have ended: DCP gathered their results
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {path}: {checks.first_failure(exc)}; nothing was "
            "published (the previous checkpoints are intact); free space or save elsewhere"
        ) from None
    gather(None, group)  # barrier: every rank's files are written
    files = hash_share(tmp, data_files(tmp), group, saved.storage_data)
    error = None
    if rank == 0:
        try:
            (tmp / META_FILE).write_text(json.dumps(dict(meta, files=files), indent=2) + "\n")
            fsync_file(tmp / META_FILE)
            fsync_dir(tmp)
            publish(tmp, path)
        except OSError as exc:
            error = f"could not publish checkpoint {path}: {exc}"
        else:
            _prune(path, keep, meta["run_id"])
    agree(error, group)  # (after the prune: no rank sees the folder mid-prune)


def _prune(path: Path, keep: int | None, run_id: str) -> None:
    """``checkpoint_files.prune`` once ``path`` is published: an older checkpoint it cannot
    remove is a warning (the new one is in place), not a failed save."""
    if keep is None:
        return
    try:
        prune(path, keep, run_id)
    except OSError as exc:
        warnings.warn(
            f"checkpoint {path} is saved, but an older one could not be removed to keep {keep} "
            f"({exc}); delete it by hand",
            stacklevel=2,
        )


# --------------------------------------------------------------------- load


def load(
    path: str | os.PathLike,
    model,
    optimizer,
    *,
    verify: bool = True,  # noqa: F811 (the argument, not the function)
    model_only: bool = False,
) -> dict:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (at any world size and
    stage) and restore the loss scaler and RNGs; returns the ``extra`` dict saved with it.
    ``model_only``: load the model's parameters and buffers alone (fine-tuning from a training
    checkpoint: ``optimizer`` is None, nothing else is restored).

    A collective: every rank of the model's group calls it.
    """
    if model_only and _optimizers(optimizer):
        raise ValueError(
            "model_only=True loads the model alone: pass None for the optimizer (to resume "
            "training, load the optimizer too: model_only=False)"
        )
    wait()  # this process's asynchronous save in flight, if any
    model = uncompiled(model)  # (a torch.compile wrapper: the model's own names)
    group = _group(model, optimizer)
    path = Path(path).expanduser().absolute()
    every_rank_calls("load", f"checkpoint {path.name}", _EACH_RANK, group)
    with diagnosed("load", f"checkpoint {path.name}", group), torch.inference_mode(False):
        _same_load(path, len(_optimizers(optimizer)), model_only, checksums=verify, group=group)
        return _load(path, model, optimizer, verify, group, model_only)


def _same_load(
    path: Path, num_optimizers: int, model_only: bool, *, checksums: bool, group
) -> None:
    """Every rank loads the same checkpoint the same way (one exchange, so every rank raises
    alike): ranks given different paths (each its own ``latest()`` while a save or a prune ran,
    file systems not shared) each read their own, and trained on a mix of two checkpoints; with
    ``model_only`` or an optimizer on some ranks only, the exchanges that follow crossed (a
    ``TypeError`` on one rank, another's data in the other's message)."""
    said = gather((str(path), num_optimizers, model_only, checksums), group)
    for i, what in enumerate(("paths", "numbers of optimizers", "model_only", "verify")):
        values = [entry[i] for entry in said]
        if len(set(values)) > 1:
            other = next(v for v in values if v != values[0])
            raise CheckpointError(
                f"the ranks passed different {what} to zeroshard.checkpoint.load ({values[0]} "
                f"on rank 0, {other} on another): every rank loads the same checkpoint, the "
                "same way (one path for all, found once: e.g. rank 0's latest() broadcast)"
            )


def _load(path: Path, model, optimizer, checksums: bool, group, model_only: bool) -> dict:
    """``load`` (a collective on ``group``). Once reading has begun, a failure (a corrupted
    file found when its last byte is hashed, after earlier bytes reached the tensors) leaves
    the engine ``untrusted`` (``Engine.check_trusted``): the next forward, step, save,
    ``full_state_dict`` (``save_pretrained``) or ``summon_full_params`` names it, instead of
    training on, or exporting, a mix of two states (the sharded state dicts stay: templates
    that a load fills); loading the model and its optimizers
    whole again clears it (``Engine.loaded``)."""
    engine = engine_of(model)
    try:
        extra = _read(path, model, optimizer, checksums, group, model_only)
    except BaseException as exc:
        if getattr(exc, "_zeroshard_read_began", False):
            engine.untrusted = (
                f"the model and its optimizer were partly overwritten by "
                f"zeroshard.checkpoint.load({str(path)!r}), which failed ({exc}); load a good "
                "state before training on, saving or reading them: zeroshard.checkpoint.load, or "
                "model.load_state_dict and each optimizer's load_state_dict"
            )
            engine.to_reload |= {id(model), *(id(o) for o in _optimizers(optimizer))}
        raise
    if model_only:
        engine.loaded(model)
    else:
        engine.untrusted, engine.to_reload = None, set()  # every part read whole
    return extra


def _resizable_buffers(model: torch.nn.Module) -> set[str]:
    """State-dict keys of the buffers whose module loads them itself (overrides
    ``_load_from_state_dict``: quantization's observers and fake-quantizers, whose scales take
    the saved shape there)."""
    own = torch.nn.Module._load_from_state_dict
    return {
        key
        for key, module, _ in rank_buffers.each_persistent_buffer(model)
        if type(module)._load_from_state_dict is not own
    }


def _read(path: Path, model, optimizer, checksums: bool, group, model_only: bool) -> dict:
    """``_load`` without the trust bookkeeping; an exception raised once tensors began to be
    overwritten is marked ``_zeroshard_read_began``."""
    rank = dist.get_rank(group)
    meta = read_meta(path)
    from zeroshard.checkpoint_planner import LoadPlanner
    from zeroshard.checkpoint_reader import Reader, read

    with _resident(model, optimizer):  # offloaded optimizer states: read into, then streamed out
        # each file read once, in threads; its checksum verified from the bytes read
        reader = Reader(path, meta["files"] if checksums else None)
        state = _state(model, optimizer, saved=checks.saved_optimizer(reader))
        own = checks.rank_state(path, meta, rank, checksums, group)
        scalers = []
        if model_only:
            del state["optim"]
        else:  # the optimizers' count first: it names what the other checks would only imply
            scalers = checks.loss_scalers(path, len(_optimizers(optimizer)), own["loss_scaler"])
            checks.optimizers(path, meta.get("optimizers"), _optimizers(optimizer))
            classes_known = meta.get("optimizers") is not None
            checks.optimizer_states(path, reader, state["optim"], classes_known)
        prefix = checks.compiled_prefix(reader, state)  # read under the names it was saved
        state["model"] = {prefix + k: v for k, v in state["model"].items()}
        checks.names(path, reader, state, {prefix + k for k in _resizable_buffers(model)})
        checks.ties(path, meta.get("tied"), tied_names(model))
        try:
            read(state, reader, LoadPlanner(), group)
            model.load_state_dict({k.removeprefix(prefix): v for k, v in state["model"].items()})
            for opt, scaler in zip(_optimizers(optimizer), scalers):
                opt.load_state_dict(state["optim"])  # each takes its own parameters' (by name)
                opt.loss_scaler.load_state_dict(scaler)
        except BaseException as exc:
            exc._zeroshard_read_began = True  # type: ignore[attr-defined]
            raise
    if meta["world_size"] == dist.get_world_size(group):  # else the model state's one copy
        rank_buffers.restore(model, own.get("buffers", {}))
    if not model_only:
        for opt in _optimizers(optimizer):
            opt.steps_taken = meta["step"]
        rng.set_state(own["rng"])
        engine_of(model).run_id = meta.get("run_id") or LEGACY_RUN  # saves continue its run
    return own["extra"]
