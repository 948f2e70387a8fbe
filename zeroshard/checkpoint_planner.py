"""DCP's default save and load planners, taught to find the boxes of ``FlatRange`` entries;
its file-system writer, taught to fail when one of its threads did.

Everything else (flattening nested state dicts, de-duplicating replicated entries, building the
global metadata, resharding reads) is DCP's own. Imported when a checkpoint is saved or loaded:
``torch.distributed.checkpoint`` costs about half a second to import.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from zeroshard.flat_range import FlatRange


class SavePlanner(DefaultSavePlanner):
    """Writes each box of a ``FlatRange`` (in the entry's ``dtype``) as a chunk of its own."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatRange):
            return obj.box(index.offset).to(obj.dtype)
        return super().lookup_object(index)


_WRITER = "_write_files_from_queue"
"""The target of DCP's writer threads (``FileSystemWriter._write_data``), in their names."""


class Writer(FileSystemWriter):
    """DCP's file-system writer, raising when a data file was not written whole: its writer
    threads drop their exceptions (to ``threading.excepthook``), so a file that one of them
    could not write (EIO at its fsync) left its entries out of the metadata, and the save
    returned, its checkpoint published, listed by ``latest()`` and refused at load."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        failed: list[BaseException] = []
        previous = threading.excepthook

        def hook(args: Any) -> None:
            # Only DCP's writer threads' (named after their target): every other thread's
            # exception goes on to the hook there was (an async save, on a thread of its own,
            # swallowed those of the whole process while it wrote).
            if args.thread is not None and _WRITER in args.thread.name:
                failed.append(args.exc_value)
            else:
                previous(args)

        threading.excepthook = hook
        try:
            future = super().write_data(plan, planner)
        finally:
            if threading.excepthook is hook:  # (not one set meanwhile by other code)
                threading.excepthook = previous
        written = {result.index for result in future.value()}
        missing = [item.index.fqn for item in plan.items if item.index not in written]
        if missing:
            why = f"{type(failed[0]).__name__}: {failed[0]}" if failed else "a writer stopped"
            raise OSError(
                f"{len(missing)} of {len(plan.items)} entries were not written (e.g. "
                f"{missing[0]}): {why}"
            )
        return future


class LoadPlanner(DefaultLoadPlanner):
    """Reads into each box of a ``FlatRange``: in place, into the tensor it views."""

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up replaces the values of types it does not know with None, in place (it
        # materializes meta tensors): the ranges are put back, nested and flattened.
        ranges: dict[tuple, FlatRange] = {}
        _collect(state_dict, (), ranges)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        fqn_of = {tuple(path): fqn for fqn, path in self.mappings.items()}
        for path, obj in ranges.items():
            parent = state_dict
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = obj
            if self.flatten_state_dict:
                self.state_dict[fqn_of[path]] = obj

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, FlatRange):
            return obj.box(index.offset)
        return super().lookup_tensor(index)


def _collect(tree: Any, path: tuple, out: dict[tuple, FlatRange]) -> None:
    """Every ``FlatRange`` in a nested state dict, by its path (DCP's flattening keys)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, FlatRange):
            out[(*path, key)] = value
        elif isinstance(value, dict | list):
            _collect(value, (*path, key), out)
