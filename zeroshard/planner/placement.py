"""Where each model state lives between uses (device, CPU or NVMe) and which placements a stage
can have: ZeRO-Offload and ZeRO-Infinity as ``zeroshard plan --offload`` names them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroshard.offload.tiers import Tier
from zeroshard.stages import partition

MODEL_STATES = ("params", "grads", "optimizer_states")
"""Model-state categories, in the order the papers list them."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which tier holds each model state between uses."""

    params: Tier = Tier.DEVICE
    """Where the parameter shards live (off the device only at stage 3: streamed per unit)."""
    grads: Tier = Tier.DEVICE
    """Where gradient shards land after reduce-scatter (with the optimizer when it is offloaded)."""
    optimizer_states: Tier = Tier.DEVICE
    """Where the optimizer states live and the optimizer step runs (CPU for NVMe too)."""

    def __post_init__(self) -> None:
        for name in MODEL_STATES:
            object.__setattr__(self, name, Tier(getattr(self, name)))

    def tier(self, category: str) -> Tier:
        return getattr(self, category)


OFFLOADS: dict[str, Placement] = {
    "none": Placement(),
    "cpu-optimizer": Placement(grads=Tier.CPU, optimizer_states=Tier.CPU),  # ZeRO-Offload
    "nvme-optimizer": Placement(grads=Tier.CPU, optimizer_states=Tier.NVME),
    # Offload(optimizer="nvme", gradients="nvme"): stages 2-3, parameters on the device
    "nvme-states": Placement(grads=Tier.NVME, optimizer_states=Tier.NVME),
    # Offload(parameters="nvme") alone: stage 3's masters streamed, states on the device
    "nvme-params": Placement(params=Tier.NVME),
    "cpu-all": Placement(params=Tier.CPU, grads=Tier.CPU, optimizer_states=Tier.CPU),
    "nvme-all": Placement(params=Tier.NVME, grads=Tier.CPU, optimizer_states=Tier.NVME),
    # zeroshard's Offload(parameters="nvme", gradients="nvme", optimizer="nvme")
    "nvme-everything": Placement(params=Tier.NVME, grads=Tier.NVME, optimizer_states=Tier.NVME),
}
"""The placements ``zeroshard plan`` and the advisor consider, by name."""


def offload_name(placement: Placement) -> str:
    """The ``OFFLOADS`` name of ``placement``, or a spelled-out one."""
    for name, known in OFFLOADS.items():
        if known == placement:
            return name
    return "/".join(f"{c}={placement.tier(c).value}" for c in MODEL_STATES)


def placement_problem(
    stage: int, placement: Placement, *, step_in_backward: bool = False
) -> str | None:
    """Why ``placement`` is not offered at ``stage`` (None when it is)."""
    part = partition(stage)
    if step_in_backward and Tier.NVME in (placement.grads, placement.optimizer_states):
        return (
            "step_in_backward: states or gradients on NVMe are streamed in step order, not "
            "during backward (the engine refuses it)"
        )
    if step_in_backward and placement.params is Tier.NVME:
        return (
            "step_in_backward: masters on NVMe are read back for the step, not during backward "
            "(the engine refuses it)"
        )
    if placement.params is not Tier.DEVICE and not part.parameters:
        return "parameters are streamed from CPU/NVMe per unit only when partitioned (stage 3)"
    if placement.grads is not Tier.DEVICE and not part.gradients:
        return "gradients leave the device only when partitioned (stage >= 2)"
    if placement.grads is Tier.NVME and placement.optimizer_states is not Tier.NVME:
        return "gradients on NVMe are streamed with the optimizer states: put both on NVMe"
    return None


def at_stage(placement: Placement, stage: int) -> Placement:
    """``placement`` as the engine runs it at ``stage``: below stage 2 the gradients are not
    partitioned and stay on the device (an offloaded optimizer takes each rank's slice of them
    at the step), whatever the named placement (``OFFLOADS``) says for them. Not gradients on
    NVMe: that placement (``nvme-states``) is refused there (``placement_problem``), not made
    another one's twin."""
    if placement.grads in (Tier.DEVICE, Tier.NVME) or partition(stage).gradients:
        return placement
    return replace(placement, grads=Tier.DEVICE)
