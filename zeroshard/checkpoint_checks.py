"""What a checkpoint save or load refuses before it writes or reads a tensor
(``zeroshard.checkpoint``): a target without the free space, an ``extra`` that
``torch.load(weights_only=True)`` would not read back, a checkpoint of another model,
optimizer or param-group layout, a damaged rank file. Each is a one-line
``CheckpointError`` naming the fix, raised on every rank alike."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.checkpoint_files import CheckpointError, agree, check_file, gather
from zeroshard.flat_range import FlatRange
from zeroshard.offload.nvme import free_bytes
from zeroshard.state_dict_layout import COMPILED, own_key

SPACE_MARGIN = 1.05  # free space wanted over the estimate (DCP metadata, pickled extras)
SPACE_PER_RANK = 2**20  # and per rank: each file's headers (a small model's may double it)


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds in the tensors of a (nested) state dict."""
    if isinstance(tree, dict):
        return sum(local_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(local_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    if isinstance(tree, FlatRange):
        return tree.nbytes
    return 0


def space(parent: Path, local_bytes: int, group) -> None:
    """Raise on every rank when the file system of ``parent`` lacks room for the estimate."""
    sizes = gather(local_bytes, group)
    need = int(sum(sizes) * SPACE_MARGIN) + SPACE_PER_RANK * len(sizes)
    error = None
    if dist.get_rank(group) == 0:
        free = free_bytes(parent)
        if free < need:
            error = (
                f"not enough free space for a checkpoint in {parent}: about {need:,} bytes needed, "
                f"{free:,} free ({need - free:,} bytes short); free space (the older checkpoints "
                "that keep= holds are removed only after a new one is complete), or save "
                "elsewhere"
            )
    agree(error, group)


def rank_file(own: dict, extra: dict) -> bytes:
    """``own`` (a rank file's state) as ``torch.save`` writes it. ``load`` reads it with
    ``torch.load(weights_only=True)``: refuse, before anything is written, an ``extra`` value
    that cannot be pickled (a lambda) or that it would refuse (numpy scalars, paths, objects)."""
    try:
        buffer = io.BytesIO()
        torch.save(own, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        return buffer.getvalue()
    except Exception as exc:
        failed = exc
    for key, value in extra.items():
        try:
            one = io.BytesIO()
            torch.save(value, one)
            torch.load(io.BytesIO(one.getvalue()), weights_only=True)
        except Exception as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if "Unpickler error" in ln]
            why = (lines or [f"{type(exc).__name__}: {exc}"])[0].split(". ")[0]
            raise CheckpointError(
                f"extra[{key!r}] (a {type(value).__name__}) could not be saved and loaded back "
                f"({why}); "
                "save tensors, numbers, strings, lists, tuples and dicts of them (e.g. float(x), "
                "str(path), torch.tensor(array))"
            ) from None
    raise CheckpointError(
        f"this rank's state could not be saved and loaded back ({type(failed).__name__}: {failed})"
    ) from failed


def loss_scalers(path: Path, given: int, saved: dict | list[dict]) -> list[dict]:
    """The saved loss scalers' states (rank file), one per optimizer: ``given`` optimizers were
    passed, and another count is a ``CheckpointError`` naming the fix."""
    saved = saved if isinstance(saved, list) else [saved]
    if len(saved) != given:
        weights = ", or model_only=True to load only the model" if saved else ""
        raise CheckpointError(
            f"checkpoint {path} holds {len(saved)} optimizer(s), and {given} were passed: pass "
            f"the optimizers it was saved with, as a list in the same order{weights}"
        )
    return saved


def class_names(optimizers: list) -> list[str]:
    """Each optimizer's class, as ``zeroshard.json`` records it (``torch.optim.adamw.AdamW``)."""
    return [f"{o.optimizer_cls.__module__}.{o.optimizer_cls.__qualname__}" for o in optimizers]


def optimizers(path: Path, saved: list[str] | None, given: list) -> None:
    """The optimizers ``given`` to a load are of the classes the checkpoint was saved with, in
    the same order (``zeroshard.json``'s ``optimizers``; None: not recorded, nothing to
    compare)."""
    given = class_names(given)
    if saved is None or saved == given:
        return
    short = [", ".join(name.rsplit(".", 1)[-1] for name in names) for names in (saved, given)]
    raise CheckpointError(
        f"checkpoint {path} was saved with optimizer(s) {short[0]}, and {short[1]} were given: "
        "pass the optimizers it was saved with, of the same classes, as a list in the same order"
    )


def saved_optimizer(reader) -> tuple[dict, dict, dict]:
    """The optimizer entries a checkpoint holds, from its metadata alone: per parameter name,
    each state key's storage metadata (a tensor's ``size`` and ``properties.dtype``, or
    bytes); per param group index, each key's; and each model entry's whole shape."""
    states: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for entry, md in reader.read_metadata().state_dict_metadata.items():
        if entry.startswith("model.") and getattr(md, "size", None) is not None:
            shapes[entry.removeprefix("model.")] = tuple(md.size)
        elif entry.startswith("optim.state."):
            name, _, key = entry.removeprefix("optim.state.").rpartition(".")
            states.setdefault(name, {})[key] = md
        elif entry.startswith("optim.param_groups."):
            index, _, key = entry.removeprefix("optim.param_groups.").partition(".")
            groups.setdefault(int(index), {})[key.split(".")[0]] = md
    return states, groups, shapes


def optimizer_states(path: Path, reader, template: dict[str, Any], classes_known: bool) -> None:
    """Fit a load template's ``optim`` (``state``: name -> key -> tensor, ``param_groups``) to
    the checkpoint, in place: a parameter whose states it does not hold (no optimizer step had
    reached it when it was saved) is dropped, so it is loaded without state and its first step
    after the resume is Adam's first (bias correction), as in the run that was not interrupted;
    a param-group key it lacks (``initial_lr`` of a scheduler made since, a key a newer torch
    added) keeps the optimizer's value. A state key it lacks is dropped when the checkpoint
    records the optimizer classes and they matched (saved with other hyperparameters, e.g.
    ``amsgrad=False``: its groups bring them back, as torch's ``load_state_dict``); else
    (another optimizer class, in a checkpoint that does not record them) a one-line
    ``CheckpointError``."""
    saved: set[str] = set()  # every key and every prefix of one (values nested in lists)
    for entry in reader.read_metadata().state_dict_metadata:
        parts = entry.split(".")
        saved.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    states = template["state"]
    for name in list(states):
        missing = [k for k in states[name] if f"optim.state.{name}.{k}" not in saved]
        if f"optim.state.{name}" not in saved:
            del states[name]
        elif missing and classes_known:
            for key in missing:
                del states[name][key]
        elif missing:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model and optimizer: it holds no optimizer "
                f"state {', '.join(sorted(missing))} for {name}, which the optimizer given keeps "
                "(another optimizer class); load it with the optimizer class(es) it was saved "
                "with, as a list in the same order"
            )
    for i, group in enumerate(template["param_groups"]):
        for key in [k for k in group if f"optim.param_groups.{i}.{k}" not in saved]:
            del group[key]


def compiled_prefix(reader, template: dict[str, Any]) -> str:
    """``COMPILED`` when the checkpoint's model entries are the model's names behind it (a
    compiled model's checkpoint of an earlier version), else ``""``."""
    entries = reader.read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in entries if k.startswith("model.")}
    ours = set(template["model"])
    if ours and saved and saved != ours and saved == {COMPILED + k for k in ours}:
        return COMPILED
    return ""


def names(path: Path, reader, template: dict[str, Any], resizable: set[str] = frozenset()) -> None:
    """Compare the checkpoint's model entries with the model's (names and shapes), and its
    number of optimizer param groups with the optimizer's. Entries in ``resizable`` (buffers
    whose module loads them itself, resizing them: quantization observers, sized at the first
    forward) are read at their saved shape instead (a new tensor in ``template``)."""
    entries = reader.read_metadata().state_dict_metadata
    groups = sum(k.startswith("optim.param_groups.") and k.endswith(".params") for k in entries)
    if "optim" in template and groups != len(template["optim"]["param_groups"]):
        raise CheckpointError(
            f"checkpoint {path} was saved with {groups} optimizer param group(s), this optimizer "
            f"has {len(template['optim']['param_groups'])}: build it with the saved run's param "
            "groups (zeroshard train makes two: weight decay on matrices, off for biases and "
            "norms), or load the weights alone (load(..., model_only=True))"
        )
    saved = {
        k.removeprefix("model."): getattr(v, "size", None)
        for k, v in entries.items()
        if k.startswith("model.")
    }
    ours = {k: getattr(v, "size", lambda: None)() for k, v in template["model"].items()}
    for k in resizable:
        size, mine = saved.get(k), template["model"].get(k)
        if size is not None and isinstance(mine, torch.Tensor) and tuple(size) != mine.shape:
            template["model"][k] = mine.new_empty(tuple(size))
            ours[k] = template["model"][k].size()
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k not in ours]
    misshaped = [
        f"{k} (saved {tuple(saved[k])}, model {tuple(ours[k])})"
        for k in ours
        if k in saved and saved[k] is not None and ours[k] is not None
        and tuple(saved[k]) != tuple(ours[k])
    ]  # fmt: skip
    parts = []
    for what, names in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("mis-shaped", misshaped),
    ):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            parts.append(f"{len(names)} {what}: {', '.join(names[:3])}{more}")
    if parts:
        fix = "build the model it was saved from (same preset and configuration)"
        if (
            missing
            and unexpected
            and {own_key(k) for k in missing} == {own_key(k) for k in unexpected}
        ):
            fix = (
                "the names differ only by torch.compile's '_orig_mod.' level: blocks compiled "
                "with torch.compile(block) were saved into or loaded from a model whose blocks "
                "are not (or the reverse); compile them the same way as the saving run, or in "
                "place with block.compile(), which keeps the names"
            )
        raise CheckpointError(f"checkpoint {path} is of another model ({'; '.join(parts)}); {fix}")


def ties(path: Path, saved: dict[str, str] | None, model_ties: dict[str, str]) -> None:
    """Refuse a model that ties parameters (one tensor under two names, ``tied_names``) which
    the checkpoint saved as two tensors (``saved``: its ``{alias: source}``; ``None`` in a
    checkpoint older than the record): each rank's reader would write pieces of both saved
    tensors into the one the model holds, a mix that changes with the layout."""
    if saved is None:
        return
    # (recorded with torch.compile's prefix by the builds that saved under it)
    saved = {k.replace(COMPILED, ""): v.replace(COMPILED, "") for k, v in saved.items()}

    def root(name: str) -> str:
        return saved.get(name, name)

    apart = [(a, s) for a, s in model_ties.items() if root(a) != root(s)]
    if apart:
        alias, source = apart[0]
        more = f" (and {len(apart) - 1} more pair(s))" if len(apart) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} holds {source!r} and {alias!r} as two tensors (saved from a model "
            f"that did not tie them), and this model ties them (one parameter){more}: loading "
            "both into one would mix them. Build the model untied, as it was saved, to load it "
            "(then tie it to the weight you choose), or tie the model that saves"
        )


def rank_state(path: Path, meta: dict[str, Any], rank: int, checksums: bool, group) -> dict:
    """The rank file ``rank`` reads (``rank-<r>.pt`` of rank ``rank % saved world size``),
    checked against its recorded size and checksum before ``torch.load`` sees it: a damaged one
    is a ``CheckpointError`` naming it on every rank (``torch.load`` would raise an ``OSError``
    or a ``UnicodeDecodeError`` naming nothing), before any tensor is overwritten."""
    name = f"rank-{rank % meta['world_size']:05d}.pt"
    state = None
    try:  # (on every rank before agree: an OSError here would leave the others waiting)
        problem = check_file(path, name, meta["files"][name]) if checksums else None
        if problem is None:
            state = torch.load(path / name, weights_only=True)
    except Exception as exc:  # verify=False, or a file damaged before its checksum was made
        problem = f"checkpoint file {path / name} cannot be read ({type(exc).__name__}: {exc})"
    agree(problem and problem.replace("\n", " "), group)
    return state


def first_failure(exc) -> str:
    """``rank R: <the error>`` for the lowest failed rank of a DCP exception (one line)."""
    rank = min(exc.failures)
    error = exc.failures[rank][0]
    said = f"rank {rank}: {type(error).__name__}: {error}".replace("\n", " ")
    if "unexpected pos" in str(error):  # torch.save's writer hides the OSError it met
        said += " (a write stopped short: the file system took no more, e.g. a full disk)"
    return said
