"""``model.save_pretrained(dir)`` of a sharded model (transformers, peft) writes the whole,
unsharded model.

Their own would save ``model.state_dict()``, DTensors of this rank's shard, which safetensors
cannot write ("Attempted to access the data pointer on an invalid python storage", with FSDP2
too), and older transformers write on every rank into the same files. ``install`` (called by
``shard``) replaces the model's ``save_pretrained`` with one that every rank of the model's
group calls (a collective, as ``full_state_dict``): the FP32 masters, in each parameter's
original dtype, are gathered to the writer's CPU memory one flat at a time, and only the
writer (the group's first rank, or its lowest given ``is_main_process=True``) calls the
original with them as
``state_dict``. It returns on every rank once the files are written, and a writer's error is
raised on every rank (none is left waiting for the next collective). A ``state_dict`` of the
caller's own goes through unchanged, unless it holds this rank's DTensor shards (refused on
every rank, naming ``full_state_dict``); a
``save_pretrained`` that takes no ``state_dict`` is left as it is. A part's own (a backbone's)
is refused with the fix, on every rank before any collective.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.state_dict import full_state_dict
from zeroshard.watchdog import diagnosed, every_rank_calls


def install(model: nn.Module) -> None:
    """Replace ``model.save_pretrained`` (module docstring), if it has one that takes a
    ``state_dict``; a part's own is refused (``_part_refused``)."""
    for name, sub in model.named_modules():
        if sub is not model and callable(getattr(sub, "save_pretrained", None)):
            sub.save_pretrained = functools.partial(_part_refused, name)
    save = getattr(model, "save_pretrained", None)
    if not callable(save) or not _takes(save, "state_dict"):
        return

    signature = inspect.signature(save)

    @functools.wraps(save)
    def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        if args:  # (save_directory, is_main_process, ...) by position: by name from here
            kwargs = _by_name(signature, save_directory, *args, **kwargs)
            save_directory = kwargs.pop(next(iter(signature.parameters)))
        given = kwargs.get("state_dict")
        if given is not None:
            _refuse_shards(given)
            return save(save_directory, **kwargs)  # the caller's own state dict
        kwargs.pop("state_dict", None)  # (None: transformers' default, which HF's Trainer passes)
        from zeroshard.engine import engine_of

        # The model's ranks (a pipeline stage's), not all; with tensor parallelism the whole
        # job's (its data-parallel group is one per tp rank: each would have written)
        mesh = engine_of(model).mesh
        group = mesh.group if mesh.tp_size == 1 else None
        every_rank_calls("save_pretrained", "the whole model", "the model's first rank writes "
                         "the files; is_main_process=... chooses another", group)  # fmt: skip
        with diagnosed("save_pretrained", "the whole model", group):
            _save_everywhere(save, save_directory, kwargs, model, group)

    model.save_pretrained = save_pretrained


def _refuse_shards(state_dict: Any) -> None:
    """A ``state_dict`` of this rank's shards (``model.state_dict()``'s DTensors): the writer
    failed in safetensors ("invalid python storage") and the other ranks returned with no
    weights written. The same on every rank (each holds its own shards), so every rank raises."""
    from torch.distributed.tensor import DTensor

    values = state_dict.values() if isinstance(state_dict, dict) else ()
    name = next((k for k, v in zip(state_dict, values) if isinstance(v, DTensor)), None)
    if name is not None:
        raise ValueError(
            f"save_pretrained(state_dict=...): {name} is a DTensor, this rank's shard "
            "(model.state_dict() of a sharded model); pass zeroshard.full_state_dict(model) "
            "(whole tensors, on rank 0), or call model.save_pretrained(path) without a "
            "state_dict: it gathers the model and rank 0 writes it"
        )


def _part_refused(name: str, *args: Any, **kwargs: Any) -> None:
    """A part's own ``save_pretrained`` (a backbone, T5's encoder) would write this rank's
    DTensor shards, which safetensors cannot (one rank failed and the others returned)."""
    raise ValueError(
        f"{name}.save_pretrained: {name} is a part of a sharded model, whose parameters each "
        "rank holds only a shard of; call save_pretrained on the model that zeroshard.shard "
        f"returned (it writes the whole model), or take the part's tensors from "
        f"zeroshard.full_state_dict(model) (keys starting with {name + '.'!r})"
    )


def _save_everywhere(
    save: Callable, save_directory: Any, kwargs: dict, model: nn.Module, group: Any
) -> None:
    """The collective part, over the model's ``group`` (None: the world): gather, the writer
    saves, every rank learns of its error. The writer is the lowest rank of the group given
    ``is_main_process=True`` (its first by default): one rank, however many were given it
    (every rank, DDP code's habit, wrote the same files at once). Ranks are the group's.

    peft's ``save_pretrained``, which runs model code (a submodule's ``state_dict()`` for its
    keys, a prompt encoder's forward: collectives at stage 3), runs on every rank at once (it
    hung: the writer waited alone in the gather): the others with ``is_main_process=False``
    and the state dict's entries as meta tensors of the same shapes."""
    me = dist.get_rank(group)
    asked = [False] * dist.get_world_size(group)
    dist.all_gather_object(asked, bool(kwargs.get("is_main_process", me == 0)), group=group)
    writer_rank = next((r for r, a in enumerate(asked) if a), None)
    writer = me == writer_rank
    state_dict = full_state_dict(model, rank0_only=not writer)
    lockstep = _runs_model_code(save) and writer_rank is not None
    if lockstep:
        state_dict = _same_keys(state_dict, writer_rank, group)
        kwargs = {**kwargs, "is_main_process": writer}
    error: str | None = None
    try:
        if writer or lockstep:
            dtype = weights_dtype(state_dict.values()) if writer else None
            with _writes_where_asked(model):
                save(save_directory, state_dict=state_dict, **kwargs)  # (empties state_dict)
            if writer:
                record_dtype(Path(save_directory), dtype, getattr(model, "config", None))
    except Exception as exc:
        error = f"save_pretrained failed on rank {dist.get_rank()}: {exc}"
        raise
    finally:
        del state_dict
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))


def _runs_model_code(save: Callable) -> bool:
    """Whether ``save`` (a model's ``save_pretrained``) is peft's, which runs model code and is
    written to be called on every process (``is_main_process`` says which one writes).
    transformers' reads only the state dict given; a model's own may write on every rank it
    runs on, or compute on the entries, so both run on the writer alone."""
    module = getattr(getattr(save, "__func__", save), "__module__", "") or ""
    return module.split(".")[0] == "peft" and _takes(save, "is_main_process")


def _same_keys(state_dict: dict[str, Any], writer: int, group: Any) -> dict[str, Any]:
    """The writer's ``state_dict`` there (``writer``: its rank in ``group``); elsewhere its
    keys with meta tensors of its entries' shapes and dtypes (no memory), so that code reading
    it runs the same on every rank."""
    mine = dist.get_rank(group) == writer
    shapes = [
        {k: (v.shape, v.dtype) if torch.is_tensor(v) else v for k, v in state_dict.items()}
        if mine
        else None
    ]
    dist.broadcast_object_list(shapes, group_src=writer, group=group)
    if mine:
        return state_dict
    return {
        k: torch.empty(v[0], dtype=v[1], device="meta") if isinstance(v, tuple) else v
        for k, v in shapes[0].items()
    }


@contextlib.contextmanager
def _writes_where_asked(model: nn.Module) -> Iterator[None]:
    """transformers 5 writes on global rank 0 only (``should_save_on_this_rank``), whatever
    ``is_main_process`` says: a writer on another rank wrote nothing, without a word. The
    gathered state dict is on the writer: it writes."""
    if not callable(getattr(model, "should_save_on_this_rank", None)):
        yield
        return
    own = model.__dict__.get("should_save_on_this_rank")  # (one of the caller's, put back)
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        if own is None:
            del model.should_save_on_this_rank
        else:
            model.should_save_on_this_rank = own


def weights_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The floating dtype of most elements of ``tensors`` (None without floating ones): a bf16
    model's FP32 masters, not the bf16 buffer that may come first."""
    counts: Counter[torch.dtype] = Counter()
    for t in tensors:
        if t.is_floating_point():
            counts[t.dtype] += t.numel()
    return counts.most_common(1)[0][0] if counts else None


def record_dtype(folder: Path, dtype: torch.dtype | None, config: Any) -> None:
    """transformers records ``model.dtype`` in ``config.json``, the first parameter's: in mixed
    precision the compute copy's (bf16, at stage 3 too: placeholders at rest have it), while
    the files hold the masters in the original dtype, and ``from_pretrained`` would load them
    in bf16. The files' dtype is written instead (in the file and in the model's config, where
    it was set too); a config.json that names no dtype gets one (an export cast to bf16 said
    nothing of it)."""
    path = folder / "config.json"
    if dtype is None or not path.is_file():
        return
    name = str(dtype).removeprefix("torch.")
    saved = json.loads(path.read_text())
    present = [k for k in ("dtype", "torch_dtype") if k in saved]
    keys = [k for k in present if saved[k] != name] if present else ["dtype"]  # (none: added)
    if not keys:
        return
    saved.update(dict.fromkeys(keys, name))
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    for key in keys:
        if config is not None and hasattr(config, key):
            setattr(config, key, name)


def _by_name(signature: inspect.Signature, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Every argument of a call by its parameter's name (a TypeError as the call would give)."""
    bound = signature.bind(*args, **kwargs).arguments
    for name, p in signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
            bound.update(bound.pop(name))  # what **kwargs collected
        elif p.kind is inspect.Parameter.VAR_POSITIONAL and name in bound:
            extra = bound.pop(name)  # (not a keyword of the call)
            if extra:
                raise TypeError(f"save_pretrained takes no extra positional arguments: {extra}")
    return dict(bound)


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` accepts a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
