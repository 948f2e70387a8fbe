"""Number formats, the declarative mixed-precision policy, and loss scalers.

Master weights and optimizer states are always FP32 (``MASTER_DTYPE``). A ``MixedPrecision``
policy says in which dtype parameters are gathered and computed on (``param_dtype``), gradients
are communicated (``reduce_dtype``), buffers are kept (``buffer_dtype``) and root outputs are
returned (``output_dtype``). Reduced gradients are always accumulated into FP32 shard gradients.

    zeroshard.shard(model, mixed_precision="bf16")              # a preset name
    zeroshard.shard(model, mixed_precision=resolve("auto", device))  # BF16 where native, else FP32
    zeroshard.optimizer(model, AdamW, lr=3e-4, loss_scaler=DynamicLossScaler(growth_interval=1000))

| name | param / reduce / buffer | loss scaler (default) | note                                 |
|------|-------------------------|-----------------------|--------------------------------------|
| fp32 | fp32                    | none (skip on inf)    |                                      |
| tf32 | fp32                    | none (skip on inf)    | TF32 matmuls on CUDA >= sm80         |
| bf16 | bf16                    | none (skip on inf)    | FP32's range: no loss scaling needed |
| fp16 | fp16                    | dynamic, 2**16        | narrow range: gradients underflow    |
| auto | bf16 where the device has native BF16, else fp32 (logged with the reason)      |

BF16 is probed per device type (``bf16_support``): CPU instruction flags, the device module's
``is_bf16_supported`` (CUDA, XPU, Ascend NPU), or a probe. TF32 exists on CUDA >= sm80 only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

MASTER_DTYPE = torch.float32

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
"""Accepted dtype names (config files and the CLI speak in names)."""


def dtype_of(value: torch.dtype | str | None, *, what: str = "dtype") -> torch.dtype | None:
    """``value`` as a floating-point ``torch.dtype``; a ValueError naming the choices otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return DTYPES[value.lower()]
        except KeyError:
            raise ValueError(
                f"unknown {what} {value!r}; choose one of: {', '.join(DTYPES)}"
            ) from None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{what} must be a floating-point torch.dtype or a name, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Which dtype each kind of tensor uses; ``None`` keeps the model's own dtype.

    Dtype fields accept a ``torch.dtype`` or a name from ``DTYPES`` ("bf16", "float16", ...).
    """

    param_dtype: torch.dtype | None = None
    """Dtype of gathered parameters, forward and backward compute, and the parameter all-gather."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reduction (defaults to ``param_dtype``). Wider than ``param_dtype``
    (e.g. FP32 with BF16 parameters) sums every rank's gradient without intermediate rounding."""
    buffer_dtype: torch.dtype | None = None
    """Dtype of floating-point module buffers saved with the model (e.g. running statistics);
    non-persistent ones (derived constants such as RoPE's inverse frequencies) keep theirs."""
    output_dtype: torch.dtype | None = None
    """Dtype the root's floating-point outputs are cast to (``None``: left as computed)."""
    cast_root_inputs: bool = True
    """Cast the root's floating-point inputs to ``param_dtype``."""
    cast_forward_inputs: bool = True
    """Cast every other unit's floating-point inputs to ``param_dtype`` as it is entered
    (FSDP2's ``cast_forward_inputs``): a unit reached by an FP32 tensor (an upcast for a stable
    softmax or norm, an FP32 buffer added to the activations) computes in ``param_dtype``
    instead of failing on mixed dtypes."""
    allow_tf32: bool = False
    """FP32 matmuls and convolutions on TF32 tensor cores (CUDA >= sm80; a warning elsewhere).
    Process-global torch state: ``shard`` turns it on and restores the previous setting when the
    last sharded model that asked for it is freed (``hold_tf32``)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            object.__setattr__(self, name, dtype_of(getattr(self, name), what=name))
        p, r = self.param_dtype, self.reduce_dtype
        if p is not None and r is not None and r.itemsize < p.itemsize:
            warnings.warn(
                f"reduce_dtype={r} is narrower than param_dtype={p}: gradients lose precision "
                "in communication; use reduce_dtype=None (same as param_dtype) or wider",
                stacklevel=3,
            )

    def resolved(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """``(param_dtype, reduce_dtype)`` with defaults filled in from the model's dtype."""
        param = self.param_dtype or model_dtype
        return param, self.reduce_dtype or param


FP32 = MixedPrecision()
"""The default policy: everything stays in the model's own dtype."""

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
PRESETS: dict[str, MixedPrecision] = {
    "fp32": MixedPrecision(param_dtype=_F32, reduce_dtype=_F32, buffer_dtype=_F32),
    "tf32": MixedPrecision(param_dtype=_F32, reduce_dtype=_F32, buffer_dtype=_F32, allow_tf32=True),
    "bf16": MixedPrecision(param_dtype=_BF16, reduce_dtype=_BF16, buffer_dtype=_BF16),
    "fp16": MixedPrecision(param_dtype=_F16, reduce_dtype=_F16, buffer_dtype=_F16),
}
"""The named policies; ``resolve`` adds "auto" and these aliases (torch's dtype names)."""
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            _BF16: "bf16", _F16: "fp16", _F32: "fp32"}  # fmt: skip


# --------------------------------------------------------------------- what the device can do
def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has BF16 arithmetic instructions.

    Rule: a ``flags`` (x86) or ``Features`` (Arm) line of ``/proc/cpuinfo`` lists ``avx512_bf16``,
    ``amx_bf16`` or ``bf16``. Where ``/proc/cpuinfo`` cannot be read (macOS, Windows), torch's
    ``get_cpu_capability()`` must name AMX. CPUs without these still run BF16, emulated and slow.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return "AMX" in torch.backends.cpu.get_cpu_capability().upper()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _device_module(device_type: str) -> Any:
    """torch's module for ``device_type`` (torch.cuda, torch.xpu, torch.npu with torch_npu...)."""
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError):
        return None


def bf16_support(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes in BF16 natively, and how that was found out (for the log).

    Per device type: CPU, the instruction flags (``cpu_has_native_bf16``); an accelerator whose
    device module has ``is_bf16_supported`` (torch.cuda, torch.xpu, torch_npu's torch.npu), its
    answer without emulation where it can say so; any other (MPS...), a tiny BF16 matmul and
    layer norm run on the device.
    """
    if device.type == "cpu":
        native = cpu_has_native_bf16()
        return native, f"the CPU {'lists' if native else 'lacks'} avx512_bf16/amx_bf16/bf16"
    check = getattr(_device_module(device.type), "is_bf16_supported", None)
    if check is not None:
        try:
            # CUDA counts sm < 80 as supported by emulation unless told not to
            native = bool(check(including_emulation=False))
            return native, f"torch.{device.type}.is_bf16_supported(including_emulation=False)"
        except TypeError:  # a device module without the emulation argument
            return bool(check()), f"torch.{device.type}.is_bf16_supported()"
    return _runs(torch.bfloat16, device), f"a BF16 probe on {device.type}"


def _runs(dtype: torch.dtype, device: torch.device) -> bool:
    """A tiny probe of the ops a model needs, in ``dtype`` on ``device``."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        torch.nn.functional.layer_norm(a @ a, (2,))
        return True
    except RuntimeError:
        return False


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` computes in ``dtype`` natively (BF16) or at all (FP16)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bf16_support(device)[0]
    if device.type == "cuda":
        return True  # every CUDA GPU torch supports computes in FP16
    return _runs(dtype, device)


def _device_name(device: torch.device) -> str:
    name = getattr(_device_module(device.type), "get_device_name", None)
    try:
        return f"{device} ({name(device)})" if name is not None else str(device)
    except (RuntimeError, AssertionError):  # not initialized / no such device
        return str(device)


def resolve(name: str | torch.dtype, device: torch.device | str) -> MixedPrecision:
    """The policy for ``name`` ("fp32", "tf32", "bf16", "fp16" or "auto") on ``device``.

    "auto" picks BF16 where ``device`` has native BF16 (see ``bf16_support``: a CUDA, XPU or NPU
    device that reports it, a CPU with BF16 instructions), else FP32, and logs the choice and the
    check it came from. "fp16" on a device that cannot compute in FP16 is a ValueError naming
    "bf16"; "bf16" on an accelerator without native BF16 is a ValueError naming "fp16" (a CPU
    still runs BF16, emulated). "tf32" where TF32 does not exist warns at ``shard`` time.
    """
    device = torch.device(device)
    key = name.lower() if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key == "auto":
        native, how = bf16_support(device)
        key = "bf16" if native else "fp32"
        log.info(
            "precision 'auto' -> %r: %s %s native BF16 (%s)",
            key,
            device.type,
            "has" if native else "lacks",
            how,
        )
        return PRESETS[key]
    if key not in PRESETS:
        raise ValueError(
            f"unknown precision {name!r}; choose one of: {', '.join([*PRESETS, 'auto'])}"
        )
    if key == "fp16" and not supports(torch.float16, device):
        raise ValueError(
            f"this torch build cannot compute in FP16 on {device.type}; use 'bf16' (same memory, "
            "FP32's range, no loss scaling) or 'fp32'"
        )
    if key == "bf16" and device.type != "cpu" and not supports(torch.bfloat16, device):
        raise ValueError(
            f"{_device_name(device)} has no native BF16; use 'fp16' (with loss scaling) or 'fp32'"
        )
    return PRESETS[key]


def policy_of(value: Any, device: torch.device) -> MixedPrecision:
    """What ``shard(mixed_precision=...)`` accepts: a MixedPrecision, a name or torch dtype for
    ``resolve``, or None."""
    if value is None:
        return FP32
    if isinstance(value, (str, torch.dtype)):  # (torch.bfloat16 was a TypeError)
        return resolve(value, device)
    if not isinstance(value, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a MixedPrecision, a name ({', '.join(PRESETS)}, auto) "
            f"or a torch dtype, got {type(value).__name__}"
        )
    return value


def unit_overrides(
    given: Mapping[type | str, MixedPrecision | str] | None,
    device: torch.device,
    default: MixedPrecision,
    model: nn.Module | None = None,
) -> dict[type | str, MixedPrecision]:
    """What ``shard(unit_precision=...)`` accepts: ``{module class or class name: policy}``
    (FSDP2's ``fully_shard(module, mp_policy=...)`` per module: a router or the norms kept in
    FP32 under a BF16 model), each policy as ``mixed_precision`` takes it. A policy without an
    ``output_dtype`` gives its outputs back in the ``default`` policy's ``param_dtype``, which
    the module's parent computes in (FSDP2 leaves them: the parent's next layer fails on mixed
    dtypes); when that keeps the model's own dtype (None), in the dtype of ``model``'s first
    floating-point parameter outside the overridden modules."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(
            "unit_precision takes {module class or class name: policy}, e.g. "
            f"{{nn.LayerNorm: 'fp32'}}; got {type(given).__name__}"
        )
    out = {}
    for key, value in given.items():
        if not (isinstance(key, str) or (isinstance(key, type) and issubclass(key, nn.Module))):
            raise TypeError(f"unit_precision keys are module classes or class names, got {key!r}")
        try:
            out[key] = policy_of(value, device)  # (None: the module's own dtype, as shard's None)
        except TypeError as exc:
            raise TypeError(f"unit_precision[{key!r}]: {exc}") from None
    back = default.param_dtype or _dtype_outside(model, out)
    for key, policy in out.items():
        if policy.output_dtype is None and back not in (None, policy.param_dtype):
            out[key] = dataclasses.replace(policy, output_dtype=back)
    return out


def _dtype_outside(model: nn.Module | None, overrides: Mapping[type | str, Any]) -> Any:
    """The dtype of ``model``'s first floating-point parameter outside the modules that
    ``overrides`` match (None if none): what the rest of the model computes in."""
    if model is None:
        return None
    inside = {
        id(p)
        for m in model.modules()
        if _override_of(m, overrides) is not None
        for p in m.parameters()
    }
    floats = (p for p in model.parameters() if p.is_floating_point() and id(p) not in inside)
    return next((p.dtype for p in floats), None)


def unit_policy(
    module: nn.Module, default: MixedPrecision, overrides: Mapping[type | str, MixedPrecision]
) -> MixedPrecision:
    """The policy of the unit made of ``module``: the first override its class matches (an
    instance of a class key, or a class named by a string key), else ``default``."""
    found = _override_of(module, overrides)
    return default if found is None else found


def _override_of(module: nn.Module, overrides: Mapping[type | str, Any]) -> Any:
    for key, policy in overrides.items():
        if type(module).__name__ == key if isinstance(key, str) else isinstance(module, key):
            return policy
    return None


# --------------------------------------------------------------------- TF32, held and restored
def cuda_has_tf32(device: torch.device) -> bool:
    """Whether CUDA ``device`` has TF32 tensor cores (compute capability 8.0, Ampere, or newer).

    CUDA-only on purpose: TF32 is an NVIDIA tensor-core format, and ``torch.accelerator`` has no
    generic query for it. (Ascend's similar HF32 is torch_npu's own setting; XPU's TF32 is
    oneDNN's. Neither is mapped here: "tf32" there warns and runs FP32.)
    """
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _tf32_switches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, value meaning TF32) for cuBLAS matmuls and cuDNN convolutions.

    torch >= 2.9 has ``fp32_precision`` ("tf32" / "ieee"); mixing it with the older
    ``allow_tf32`` booleans is an error in torch, so only the newest API present is used.
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        return [(matmul, "fp32_precision", "tf32"), (conv.conv, "fp32_precision", "tf32")]
    return [(matmul, "allow_tf32", True), (conv, "allow_tf32", True)]


_TF32_LOCK = threading.Lock()
_tf32_holders = 0  # sharded models alive that asked for TF32
_tf32_saved: list[Any] | None = None  # the switches as they were before the first holder


def hold_tf32(policy: MixedPrecision, device: torch.device) -> Callable[[], None] | None:
    """Turn TF32 on for CUDA matmuls and cuDNN convolutions while the caller holds it.

    TF32 is process-global torch state (``torch.backends.cuda.matmul`` and ``cudnn``); this is
    the only place zeroshard sets it. Returns the release function, or None when nothing was set
    (``policy.allow_tf32`` is False, or the device has no TF32: a warning says so). The switches
    are saved when the first holder arrives and restored when the last one releases: ``shard``
    releases when its model is freed, so a process leaves TF32 as it found it once its last
    sharded "tf32" model is gone. Each release function acts once.
    """
    global _tf32_holders, _tf32_saved
    if not policy.allow_tf32:
        return None
    if not cuda_has_tf32(device):
        warnings.warn(
            f"TF32 has no effect on {device}: it needs CUDA tensor cores (sm80 or newer); "
            "training runs in plain FP32",
            stacklevel=3,
        )
        return None
    with _TF32_LOCK:
        if _tf32_holders == 0:
            switches = _tf32_switches()
            _tf32_saved = [getattr(obj, attr) for obj, attr, _ in switches]
            for obj, attr, on in switches:
                setattr(obj, attr, on)
        _tf32_holders += 1
    released = threading.Event()

    def release() -> None:
        global _tf32_holders, _tf32_saved
        if released.is_set():
            return
        released.set()
        with _TF32_LOCK:
            _tf32_holders -= 1
            if _tf32_holders == 0 and _tf32_saved is not None:
                for (obj, attr, _), old in zip(_tf32_switches(), _tf32_saved):
                    setattr(obj, attr, old)
                _tf32_saved = None

    return release


# --------------------------------------------------------------------- loss scaling
@dataclass(kw_only=True)
class LossScaler:
    """Static loss scaling: ``backward`` multiplies the loss by ``scale``; ``step`` divides the
    FP32 shard gradients by it. Steps whose gradients hold inf/NaN on any rank are skipped when
    ``skip_nonfinite`` (master weights and optimizer states untouched)."""

    scale: float = 1.0
    """Loss multiplier (1.0: none, the default for FP32 and BF16)."""
    skip_nonfinite: bool = True
    """Skip a step whose gradients hold inf/NaN (costs one one-element all-reduce per step)."""
    num_skipped: int = field(default=0, init=False)
    """Steps skipped so far."""
    num_skipped_in_a_row: int = field(default=0, init=False)
    """Steps skipped since the last step taken."""
    warn_on_skip: bool = True
    """Warn at the 1st, 10th, 100th ... skipped step in a row (``skip_warning``): a static scale
    lowers nothing, so a skip repeats while its cause stays."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {self.scale}")

    @property
    def checks(self) -> bool:
        """Whether ``step`` must look for inf/NaN gradients."""
        return self.skip_nonfinite

    def claim(self, optimizer: object, holds: Callable[[Any], bool]) -> None:
        """Bind this scaler to the one optimizer whose ``step`` updates it. Shared by two, it was
        updated by each of their steps (a scale halved twice for one overflow, doubled every
        growth_interval / 2 clean steps): a ValueError while another optimizer that still
        ``holds`` gradients to step has it (one replaced by a rebuild hands it on)."""
        owner = getattr(self, "_owner", None)
        held = owner() if owner is not None else None
        if held is not None and held is not optimizer and holds(held):
            raise ValueError(
                f"this {type(self).__name__} already belongs to another zeroshard optimizer, "
                "whose step() updates it once per step: each optimizer needs a loss scaler of "
                "its own (loss_scaler=zeroshard.DynamicLossScaler()); the loss is scaled by the "
                "scaler of the optimizer whose backward() is called"
            )
        self._owner = weakref.ref(optimizer)

    def scale_for(self, loss: torch.Tensor) -> float:
        """The scale to multiply ``loss`` by: the loss's own gradient is the scale, in the
        loss's dtype, so above that dtype's range (FP16: 65504) every step would overflow. A
        static scale there is a ValueError."""
        if loss.dtype.is_floating_point and self.scale > torch.finfo(loss.dtype).max:
            raise ValueError(
                f"a loss scale of {self.scale:g} overflows the gradient of a {loss.dtype} loss "
                f"(at most {torch.finfo(loss.dtype).max:g}): compute the loss in FP32 "
                f"(loss.float()) or use a smaller scale"
            )
        return self.scale

    def update(self, found_inf: bool, *, scaled_here: bool = True) -> None:
        """Record one step's outcome (the same on every rank); ``scaled_here``: whether the
        gradients carry this scaler's scale (not another optimizer's, whose ``backward`` took
        the loss through this one's model too: that scaler is told, ``overflowed_elsewhere``)."""
        self.num_skipped += int(found_inf)
        self.num_skipped_in_a_row = self.num_skipped_in_a_row + 1 if found_inf else 0

    def overflowed_elsewhere(self) -> None:
        """Gradients of a loss this scaler scaled overflowed in a model that another optimizer
        steps (one loss through two models sharded apart): a static scale changes nothing."""

    def skip_warning(self) -> str | None:
        """After ``update``: what to warn about the step just skipped, at the 1st, 10th, 100th
        ... in a row (a run that skipped every step trained nothing without a word)."""
        n = self.num_skipped_in_a_row
        if not (self.warn_on_skip and n and 10 ** (len(str(n)) - 1) == n):
            return None
        return (
            f"optimizer step skipped: gradients hold inf/NaN on some rank ({n} step(s) in a "
            f"row, {self.num_skipped} in all; master weights untouched). A static loss scale "
            "lowers nothing, so steps stay skipped while the cause stays. At stage 3 a "
            "parameter read outside its own unit's forward reads its NaN placeholder at rest: "
            "a penalty over model.parameters() in the loss (compute it in a module's forward), "
            "or a module using another unit's weight directly, e.g. F.linear(h, "
            "self.embed.weight) for a tied head (call the owning module, or wrap both in one "
            "unit); or run forward and backward inside `with "
            "zeroshard.summon_full_params(model):`. Otherwise lower the learning rate or look "
            "for inf/NaN in the data (LossScaler(warn_on_skip=False) silences this)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "scale": self.scale, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``; its scale only from a scaler of the same kind (a BF16 run's 1.0
        would leave an FP16 run at the minimum scale, an FP16 run's scale would stay on in
        FP32 for good)."""
        self.num_skipped = int(state.get("num_skipped", 0))
        if self.same_kind(state):
            self.scale = float(state["scale"])

    def same_kind(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` came from a scaler of this one's class (older states, without a
        ``kind``: told apart by the dynamic scaler's own fields; ``torch.amp.GradScaler``'s is
        dynamic)."""
        dynamic = "clean_steps" in state or "_growth_tracker" in state
        kind = state.get("kind", "DynamicLossScaler" if dynamic else "LossScaler")
        return kind == type(self).__name__


@dataclass(kw_only=True)
class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling for FP16: start at ``init_scale``; on a step with inf/NaN gradients
    skip it and multiply the scale by ``backoff_factor``; after ``growth_interval`` clean steps
    in a row multiply it by ``growth_factor``. A non-finite gradient at ``min_scale`` raises
    ``FloatingPointError``: the model diverged, no scale can fix it."""

    init_scale: float = 2.0**16
    """First scale (``scale`` starts here)."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` clean steps."""
    backoff_factor: float = 0.5
    """Multiplier on a step with inf/NaN gradients."""
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""
    hysteresis: int = 1
    """Consecutive inf/NaN steps before the scale is lowered (each one is still skipped);
    1 lowers it at once. A clean step restores the count."""
    min_scale: float = 1.0
    """The scale never goes below this; inf/NaN gradients here raise ``FloatingPointError``."""
    max_scale: float = 2.0**24
    """The scale never grows above this."""
    skip_nonfinite: bool = field(default=True, init=False)
    warn_on_skip: bool = field(default=False, init=False)
    """Off: lowering the scale is the remedy, and at its minimum it raises."""
    scale: float = field(default=0.0, init=False)
    _clean_steps: int = field(default=0, init=False, repr=False)
    _hysteresis_left: int = field(default=0, init=False, repr=False)
    _losses: int = field(default=0, init=False, repr=False)  # losses scaled so far
    _own_inf_for: int = field(default=-1, init=False, repr=False)  # (which loss's overflow
    _foreign_inf_for: int = field(default=-1, init=False, repr=False)  # was seen where)
    _before_clean: tuple = field(default=(-1,), init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                "need 0 < min_scale <= init_scale <= max_scale, got "
                f"{self.min_scale}, {self.init_scale}, {self.max_scale}"
            )
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {self.growth_factor} "
                f"and {self.backoff_factor}"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1, got {self.growth_interval} and "
                f"{self.hysteresis}"
            )
        self.scale = float(self.init_scale)
        self._hysteresis_left = self.hysteresis

    def scale_for(self, loss: torch.Tensor) -> float:
        """The scale, kept within what a ``loss`` of its dtype carries as its gradient."""
        self.fit(loss.dtype)
        self._losses += 1
        return self.scale

    def fit(self, dtype: torch.dtype) -> None:
        """Keep the scale (and ``max_scale``) at most the largest power of two of ``dtype``: a
        loss, or any scalar on its way to it, in that dtype carries the scale itself as its
        gradient (FP16: 2**15; at 2**16 every step was skipped, and again at each growth).
        ``default_scaler`` fits it to FP16 for a model computing in FP16."""
        cap = _largest_power_of_two(dtype)
        self.max_scale = min(self.max_scale, max(cap, self.min_scale))
        self.scale = min(self.scale, self.max_scale)

    def update(self, found_inf: bool, *, scaled_here: bool = True) -> None:
        super().update(found_inf)
        if not scaled_here:
            return  # another scaler's scale: that one lowers (``overflowed_elsewhere``)
        if found_inf:
            self._own_inf_for = self._losses
            if self._foreign_inf_for != self._losses:  # (once per loss, as one torch scaler)
                self._lower()
            return
        if self._foreign_inf_for == self._losses:
            return  # this loss overflowed in another model: not a clean step
        # Undone if the other model's step, later, finds this loss overflowed there.
        self._before_clean = (self._losses, self.scale, self._clean_steps, self._hysteresis_left)
        self._clean_steps += 1
        self._hysteresis_left = self.hysteresis
        if self._clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self._clean_steps = 0

    def overflowed_elsewhere(self) -> None:
        """Lower the scale for an overflow of this scaler's loss in a model another optimizer
        steps (its skip decision is its own, as ``torch.amp.GradScaler.step`` per optimizer;
        the scale is lowered once per loss, as by one scaler's ``update()`` after both steps)."""
        if self._losses in (self._own_inf_for, self._foreign_inf_for):
            return
        self._foreign_inf_for = self._losses
        if self._before_clean[0] == self._losses:  # counted clean by this one's own step
            self.scale, self._clean_steps, self._hysteresis_left = self._before_clean[1:]
        self._lower()

    def _lower(self) -> None:
        self._clean_steps = 0
        if self.scale <= self.min_scale:
            raise FloatingPointError(
                f"gradients hold inf/NaN at the minimum loss scale {self.min_scale}: training "
                "diverged (an FP16 range problem would have cleared by now); lower the learning "
                "rate, clip gradients, or train in bf16"
            )
        self._hysteresis_left -= 1
        if self._hysteresis_left <= 0:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return dict(
            super().state_dict(),
            clean_steps=self._clean_steps,
            hysteresis_left=self._hysteresis_left,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not self.same_kind(state):
            return
        # torch.amp.GradScaler's state: its clean steps and settings, as its load_state_dict does.
        self._clean_steps = int(state.get("clean_steps", state.get("_growth_tracker", 0)))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
        for name in ("growth_factor", "backoff_factor", "growth_interval"):
            if "_growth_tracker" in state and name in state:
                setattr(self, name, type(getattr(self, name))(state[name]))


def _largest_power_of_two(dtype: torch.dtype) -> float:
    """The largest power of two that ``dtype`` holds (inf for a non-float dtype)."""
    if not dtype.is_floating_point:
        return math.inf
    return math.ldexp(1.0, math.frexp(torch.finfo(dtype).max)[1] - 1)


def default_scaler(param_dtypes: set[torch.dtype], given: LossScaler | None = None) -> LossScaler:
    """``given``, or dynamic scaling when any gradient is computed in FP16, else none (skip on
    inf/NaN); a dynamic one of an FP16 model kept within FP16 (``fit``: an FP32 loss of FP16
    terms overflows at 2**16 too)."""
    fp16 = torch.float16 in param_dtypes
    scaler = given or (DynamicLossScaler() if fp16 else LossScaler())
    if fp16 and isinstance(scaler, DynamicLossScaler):
        scaler.fit(torch.float16)
    return scaler
