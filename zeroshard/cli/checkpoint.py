"""``zeroshard checkpoint info PATH``: what a checkpoint folder holds, and whether it is complete.

It reads ``zeroshard.json`` and the file sizes (``--verify`` also recomputes every file's
checksum); it loads nothing and needs no process group. Exit status 0 for a complete
checkpoint, 1 for an incomplete or damaged one, 2 for a path that is none (a run's folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from zeroshard import checkpoint
from zeroshard.checkpoint_files import CheckpointError, NotACheckpoint


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "checkpoint",
        help="inspect checkpoints written by zeroshard.checkpoint.save",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = actions.add_parser("info", help="step, world size, stage, precision, size, complete?")
    info.add_argument("path", type=Path, help="a checkpoint folder")
    info.add_argument("--verify", action="store_true", help="recompute every file's checksum")
    info.add_argument("--json", action="store_true", help="print the fields as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint.read_meta(args.path)
    except NotACheckpoint as exc:  # (a run's folder, an export: the wrong path, exit 2)
        return _not_one(args, str(exc))
    except (CheckpointError, OSError):
        pass  # (what info tells: incomplete or damaged)
    try:
        found, state = checkpoint.info(args.path), "incomplete"
    except FileNotFoundError as exc:
        if not args.json:
            raise  # (the command's error line)
        return _not_one(args, str(exc))
    if found.complete and args.verify:
        problem = checkpoint.verify(args.path)
        if problem:
            found = dataclasses.replace(found, complete=False, problem=problem)
            state = "damaged"  # (every file there, one not as saved)
    if args.json:
        print(json.dumps(dataclasses.asdict(found), indent=2))
        return 0 if found.complete else 1
    if not found.complete:
        problem = found.problem or state
        if not problem.startswith(found.path):  # read_meta's problems name the folder already
            problem = f"{found.path}: {state}: {problem}"
        # (none: not a checkpoint at all, e.g. a run's folder of them; "0 bytes" read as empty)
        print(
            f"{problem} ({found.size_bytes:,} bytes in its files)" if found.size_bytes else problem
        )
        return 1
    tp = f" (tensor-parallel {found.tensor_parallel})" if found.tensor_parallel > 1 else ""
    classes = [name.rsplit(".", 1)[-1] for name in found.optimizers or []]
    optimizers = f", optimizer {', '.join(classes)}" if classes else ""
    k = _known
    print(
        f"{found.path}: complete\n"
        f"  step {k(found.step)}, world size {k(found.world_size)}{tp}, stage {k(found.stage)}, "
        f"param dtype {k(found.param_dtype)} (reduce {k(found.reduce_dtype)})"
        f"{optimizers}\n"
        f"  {_count(found.num_params)} parameters, {found.size_bytes / 2**20:.1f} MiB on disk "
        f"({found.size_bytes:,} bytes), zeroshard {k(found.zeroshard_version)}"
    )
    return 0


def _not_one(args: argparse.Namespace, problem: str) -> int:
    """``args.path`` is no checkpoint at all (exit 2): said in a line, or with ``--json`` in
    the fields a script reads (it was that line there too, no JSON)."""
    if args.json:
        print(json.dumps({"path": str(args.path), "complete": False, "problem": problem}))
    else:
        print(problem)
    return 2


def _known(value: object) -> str:
    """``value``, or "unknown" where the metadata lacks it (a zeroshard.json written by hand
    or by another tool)."""
    return "unknown" if value is None else str(value)


def _count(n: int | None) -> str:
    """``n`` with thousands separators; "an unknown number of" where the metadata lacks it."""
    return "an unknown number of" if n is None else f"{n:,}"
