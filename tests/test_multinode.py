"""Two nodes on one machine: two torchrun agents, started as separate processes, meet through c10d
rendezvous on 127.0.0.1 and train the GPT; the losses equal the same world size launched as one
node (``zeroshard train --nproc N``), bit for bit.

These are the commands of README's "On N GPUs, and on several nodes" (there on real hosts). Each
test starts the two agents and the one-node reference at once (the machine's cores are shared
and most of the time is start-up), each under a wall-clock bound, so that a rendezvous that never
completes fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.testing import free_port

# Wall-clock bounds and short timeouts: run by `make test` after the parallel tests, with the
# machine to itself (pyproject.toml's "alone" marker).
pytestmark = pytest.mark.alone

# Tiny on purpose: the test is about launching, rendezvous and rank placement, not training.
TRAIN = ["--preset", "nano", "--steps", "3", "--batch-size", "4", "--seq-len", "16"]
TRAIN += ["--log-every", "1", "--eval-every", "3", "--eval-batches", "1", "--stage", "3"]
BOUND_S = 180


def _agent(node_rank: int, nproc_per_node: int, port: int, out: Path, data: Path) -> list[str]:
    """One node's command: ``torchrun --nnodes 2 --node-rank R ... -m zeroshard.cli.main train``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "-m", "zeroshard.cli.main", "train", *TRAIN,
        "--out-dir", str(out), "--data-dir", str(data),
    ]  # fmt: skip


def _losses(out: Path) -> list[tuple[str, int, float]]:
    """(kind, step, loss) of every record of ``out/metrics.jsonl`` (train and validation)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in records]


def test_two_nodes_train_as_one(tmp_path):
    """Two ranks per node: the local ranks of each node map onto the right global ranks."""
    nproc_per_node = 2
    world = 2 * nproc_per_node
    data, two, one = tmp_path / "data", tmp_path / "two-nodes", tmp_path / "one-node"
    port = free_port()
    commands = [_agent(node, nproc_per_node, port, two, data) for node in (0, 1)]
    commands.append(
        [sys.executable, "-m", "zeroshard.cli.main", "train", "--nproc", str(world), *TRAIN,
         "--out-dir", str(one), "--data-dir", str(data)]
    )  # fmt: skip
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    try:
        logs = [p.communicate(timeout=BOUND_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    # The two agents formed one job of 2 x nproc_per_node ranks (not two jobs of their own).
    # Whichever node holds rank 0 writes the outputs: c10d rendezvous numbers the nodes in the
    # order they join and ignores --node-rank.
    for out in (two, one):
        assert json.loads((out / "summary.json").read_text())["ranks"] == world
    losses = _losses(two)
    assert [kind for kind, _, _ in losses] == ["eval", "train", "train", "train", "eval"]
    assert losses == _losses(one)  # identical: same ranks, same batches, same reduction order
