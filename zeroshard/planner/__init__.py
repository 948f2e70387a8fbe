"""The planner: will a model fit, and how fast can it go, per stage and offload placement?

Pure functions of numbers returning breakdowns in bytes by category (DESIGN.md §3, §4, §8):

- ``describe``: a model as a parameter count, a transformer shape, a GPT preset, an ``nn.Module``
  (counted on the meta device) or a Hugging Face config;
- ``memory``: model states and residual states per device, by category and tier;
- ``timeline``: the engine's device memory moment by moment through a step (its peak);
- ``hf``: Hugging Face configs built on the meta device (``transformers`` optional);
- ``report``: what ``zeroshard plan`` prints: the plan and the advice as JSON-ready dicts, and
  their tables;
- ``comm``: data-parallel communication per step, per collective, inside and across shard
  groups (hybrid sharding);
- ``bandwidth``: ZeRO-Infinity's arithmetic intensity, efficiency and required bandwidth;
- ``flops``: a built model's FLOPs per micro-batch, counted on the meta device;
- ``advise``: feasible configurations ranked by estimated step time, and why the rest fail;
- ``units``: "80GB" / "80GiB" / "70GB/s" / "70TFLOP/s" / "7.5B" parsing for the CLI edge;
- ``calibrate``: the one module that runs torch: trains a GPT preset for real on the current
  process group and holds the prediction against MemTracker and the ledger (``zeroshard plan
  --measure``); not imported here.
"""

from zeroshard.planner.advise import Advice, Candidate, Cluster, Workload, advise
from zeroshard.planner.bandwidth import (
    Intensity,
    efficiency,
    flops_per_iteration,
    intensity,
    required_bandwidth,
)
from zeroshard.planner.comm import Collective, comm_seconds, dp_communication
from zeroshard.planner.describe import (
    ModelDescription,
    TransformerShape,
    from_gpt,
    from_hf_config,
    from_module,
    from_params,
    from_transformer,
)
from zeroshard.planner.memory import (
    MODEL_STATES,
    OFFLOADS,
    RESIDUAL_STATES,
    ZERO,
    ZERO_INFINITY,
    BytesPerParam,
    MemoryBreakdown,
    MemoryConfig,
    Placement,
    Tier,
    activation_checkpoint_bytes,
    activation_working_bytes,
    model_state_working_bytes,
    model_states,
    plan_memory,
)
from zeroshard.planner.saved import Inputs
from zeroshard.planner.timeline import saved_activation_bytes_per_layer

__all__ = [
    "MODEL_STATES",
    "OFFLOADS",
    "RESIDUAL_STATES",
    "ZERO",
    "ZERO_INFINITY",
    "Advice",
    "BytesPerParam",
    "Candidate",
    "Cluster",
    "Collective",
    "Inputs",
    "Intensity",
    "MemoryBreakdown",
    "MemoryConfig",
    "ModelDescription",
    "Placement",
    "Tier",
    "TransformerShape",
    "Workload",
    "activation_checkpoint_bytes",
    "activation_working_bytes",
    "advise",
    "comm_seconds",
    "dp_communication",
    "efficiency",
    "flops_per_iteration",
    "from_gpt",
    "from_hf_config",
    "from_module",
    "from_params",
    "from_transformer",
    "intensity",
    "model_state_working_bytes",
    "model_states",
    "plan_memory",
    "required_bandwidth",
    "saved_activation_bytes_per_layer",
]
