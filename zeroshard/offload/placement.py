"""``Offload``: on which memory tier each model state lives (ZeRO-Offload / ZeRO-Infinity).

    model = zeroshard.shard(model, stage=2, offload=zeroshard.Offload(optimizer="nvme",
                                                                     folder="/nvme/run"))

One field per model state of the ZeRO paper, each ``None`` (the device), ``"cpu"`` or ``"nvme"``.
The store's own tuning (block size, I/O threads, buffers) is ``OffloadConfig``; ``Offload`` only
says where things live and builds the per-rank ``OffloadConfig`` from it.

What is implemented (the rest is refused at ``shard()`` with the fix):
- optimizer="nvme": the sharded optimizer's states (Adam's momentum and variance, ...) live in
  swap files and are streamed through a ring of host buffers, one sub-group at a time
  (``zeroshard.model_states.state_swap``). The FP32 master stays in memory (the engine reads it
  to refresh the compute parameters after the step) unless parameters="nvme" too.
- gradients="nvme" (with optimizer="nvme"): each reduced gradient shard is written as its
  reduction finishes and read back at the step (``zeroshard.model_states.grad_swap``).
- parameters="nvme" (stage 3): each FlatParam's FP32 master shard lives in swap files between
  uses, read back ``param_prefetch`` units ahead of its gather along the engine's order and
  written back after the optimizer step (``zeroshard.model_states.param_swap``).
- optimizer="cpu", gradients="cpu", parameters="cpu" on a CPU device: the states already live in
  host memory; accepted (nothing moves, said in a log line) so that one configuration runs on
  both kinds of machine. On an accelerator they are not implemented yet.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zeroshard.stages import STAGES, Partition

from .folder import discard_folder
from .store import OffloadConfig
from .tiers import OffloadError, Tier

__all__ = ["Offload", "discard_absent_ranks"]

logger = logging.getLogger("zeroshard.offload")

_STORES = {"states": "", "params": "-params", "activations": "-activations"}
"""The stores of one rank, by what they hold: the suffix of their folder's name."""
RANK_FOLDER = re.compile(
    rf"rank(?P<rank>\d{{5}})(?:{'|'.join(v for v in _STORES.values() if v)}|-states\d+)?"
)
"""The per-rank store folders that ``Offload`` makes under its ``folder`` (``-states1``...: the
states of a model's second, third... optimizer)."""

_PLACES = (None, "cpu", "nvme")


def _tier_name(field: str, value: object) -> str | None:
    if isinstance(value, Tier):
        value = None if value is Tier.DEVICE else value.value
    if value not in _PLACES:
        raise ValueError(f"{field}={value!r} must be None (the device), 'cpu' or 'nvme'")
    return value  # type: ignore[return-value]


_STATES = ("optimizer", "gradients", "parameters", "activations")
"""The placements an ``Offload`` names: model states, then activation checkpoints."""


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Where each model state (and activation checkpoints) lives; ``None`` keeps it on the
    training device."""

    optimizer: str | None = None
    """FP32 optimizer states (Adam: 8 bytes per trainable element this rank owns): None, 'cpu'
    or 'nvme' (swap files in ``folder``, streamed sub-group by sub-group at the step)."""
    gradients: str | None = None
    """The reduced FP32 gradient shard (4 bytes per owned element): None, 'cpu' or 'nvme'
    (written as each reduction finishes, read back at the step; needs optimizer='nvme').
    Needs partitioned gradients (stage 2 or 3)."""
    parameters: str | None = None
    """The FP32 master shard of the parameters (4 bytes per owned element): None, 'cpu' or
    'nvme' (swap files in ``folder``, read back ahead of each unit's gather). Needs partitioned
    parameters (stage 3)."""
    activations: str | None = None
    """Activation checkpoints (ZeRO-R's Pa+cpu; needs ``ShardConfig.checkpoint_every``): None,
    'cpu' or 'nvme' (``<folder>/rank<r>-activations``). Each span's saved input (its 1/Nm piece
    with ``partition_activations``) is written there in forward and read back ahead of its
    recomputation (``zeroshard.residual_states.partitioned``)."""
    param_prefetch: int = 1
    """parameters='nvme': units whose masters are read ahead, beyond the units whose gather is
    already being prefetched (``ShardConfig.num_prefetch``), along the forward/backward order."""
    folder: str | os.PathLike | None = None
    """Directory for the swap files when any state is on 'nvme' (one sub-folder per rank,
    ``rank00000`` ..., and ``rank00000-params`` ... for parameters), on the fast disk. Checked for
    writability and free space before step 1 (by ``shard`` for parameters, by the optimizer for
    its states)."""
    _root: Path | None = field(init=False, repr=False, compare=False, default=None)
    """``folder`` made absolute at construction."""

    def __post_init__(self) -> None:
        for name in _STATES:
            object.__setattr__(self, name, _tier_name(name, getattr(self, name)))
        if self.folder is not None and not isinstance(self.folder, (str, os.PathLike)):
            raise TypeError(
                f"folder={self.folder!r} must be a path (a str or os.PathLike), got a "
                f"{type(self.folder).__name__}"
            )
        # Absolute now: a later os.chdir must not move the swap files' folder under the run.
        root = None if self.folder is None else Path(self.folder).expanduser().absolute()
        object.__setattr__(self, "_root", root)
        on_disk = [f for f in _STATES if getattr(self, f) == "nvme"]
        if on_disk and (self.folder is None or not str(self.folder).strip()):
            raise ValueError(
                f"{on_disk[0]}='nvme' needs folder=, a directory on the fast disk for swap files"
                f"{'' if self.folder is None else f' (got {self.folder!r})'}"
            )
        if not on_disk and self.folder is not None:
            raise ValueError("folder= is only used by 'nvme' placements; drop it or use 'nvme'")
        prefetch = self.param_prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"param_prefetch={prefetch!r} must be an int >= 0")
        if prefetch != 1 and self.parameters != "nvme":  # (else ignored without a word)
            raise ValueError("param_prefetch is only used by parameters='nvme'; drop it")
        if self.gradients == "nvme" and self.optimizer != "nvme":
            raise ValueError(
                "gradients='nvme' needs optimizer='nvme' (the step reads them back from the "
                "optimizer's swap files); set both, or gradients='cpu'"
            )

    def check(self, partition: Partition, device: torch.device) -> None:
        """A ValueError for a placement this stage or device cannot have (called by shard)."""
        stage = next((k for k, v in STAGES.items() if v == partition), "?")
        if self.parameters and not partition.parameters:
            raise ValueError(
                f"parameters={self.parameters!r} at stage {stage} is not possible: it "
                "needs partitioned parameters; use stage=3 or parameters=None (below stage 3 "
                "every rank keeps all parameters on the device)"
            )
        if self.gradients and not partition.gradients:
            raise ValueError(
                f"gradients={self.gradients!r} at stage {stage} needs partitioned gradients: use "
                "stage=2 or 3, or gradients=None (below stage 2 the full gradient stays on the "
                "device)"
            )
        on_host = [f for f in ("optimizer", "gradients", "parameters") if getattr(self, f)]
        if device.type != "cpu" and on_host:
            raise ValueError(
                f"{on_host[0]}={getattr(self, on_host[0])!r} on a {device.type} device is not "
                "implemented yet (host offload runs only with CPU training); use None there"
            )

    @property
    def any(self) -> bool:
        return any(getattr(self, f) for f in _STATES)

    def log_host_tiers(self, partition: Partition, device: torch.device, log) -> None:
        """Say where a 'cpu' placement's states are on a CPU run: nothing moves."""
        if self.parameters == "cpu" and device.type == "cpu" and partition.parameters:
            log.info(
                "parameters on the CPU tier: the FP32 master shards stay in host memory "
                "(training runs on the CPU: they are there already, nothing moves)"
            )

    def store_config(self, rank: int, index: int = 0) -> OffloadConfig:
        """The NVMe store of ``rank``'s optimizer states: its own sub-folder of ``folder``
        (``index`` k >= 1: another optimizer's, in ``rank00003-states<k>``)."""
        folder = self._rank_folder(rank, "states")
        if index:
            folder = folder.with_name(f"{folder.name}-states{index}")
        return OffloadConfig(tier=Tier.NVME, folder=folder)

    def activation_store_config(self, rank: int) -> OffloadConfig | None:
        """The store of ``rank``'s activation checkpoints (None: the CPU tier's default)."""
        if self.activations != "nvme":
            return None
        return OffloadConfig(tier=Tier.NVME, folder=self._rank_folder(rank, "activations"))

    def param_store_config(self, rank: int) -> OffloadConfig:
        """The NVMe store of ``rank``'s parameter masters: a sibling of its state store's folder
        (``rank00000-params``; each store locks its own folder)."""
        return OffloadConfig(tier=Tier.NVME, folder=self._rank_folder(rank, "params"))

    def _rank_folder(self, rank: int, store: str) -> Path:
        """``folder/rank00003`` (the states' store), ``rank00003-params``, ..."""
        assert self._root is not None
        return self._root / f"rank{rank:05d}{_STORES[store]}"


def discard_absent_ranks(folder: Path, world_size: int) -> list[Path]:
    """Delete the per-rank store folders under ``folder`` of ranks that the job, now of
    ``world_size`` ranks, does not have: a crashed run of more ranks left them (a restart at a
    smaller world size after a node left), and no rank opens them to discard them itself. Their
    swap files are never read again (states come back from checkpoints); a folder whose lock a
    live store holds (another job sharing ``folder``) is left alone. The folders deleted."""
    gone = []
    try:
        children = sorted(folder.iterdir())
    except OSError:  # best effort, on one rank: never an error that the others would wait on
        return gone
    for child in children:
        m = RANK_FOLDER.fullmatch(child.name)
        if m is None or int(m["rank"]) < world_size or not child.is_dir():
            continue
        try:
            discard_folder(child)
        except (OffloadError, OSError):
            continue  # a live store's, or no store's: not this job's to delete
        gone.append(child)
    if gone:
        logger.warning(
            "discarded the swap folders of ranks this job of %d rank(s) does not have: %s",
            world_size, ", ".join(p.name for p in gone),
        )  # fmt: skip
    return gone
