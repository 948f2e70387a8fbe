"""Number formats and the declarative mixed-precision policy (loss scalers: ``loss_scaling``).

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
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.loss_scaling import (  # noqa: F401 (their home before: old imports work)
    DynamicLossScaler,
    LossScaler,
    default_scaler,
)

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
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}
"""Accepted dtype names (config files and the CLI speak in names), also as ``torch.<name>``."""

ARITHMETIC_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The floating-point dtypes a precision field may take (float8 has no arithmetic of its own)."""


def dtype_of(value: torch.dtype | str | None, *, what: str = "dtype") -> torch.dtype | None:
    """``value`` as a floating-point ``torch.dtype``; a ValueError naming the choices otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return DTYPES[value.lower().removeprefix("torch.")]
        except KeyError:
            raise ValueError(
                f"unknown {what} {value!r}; choose one of: {', '.join(DTYPES)}"
            ) from None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{what} must be a floating-point torch.dtype or a name, got {value!r}")
    if value not in ARITHMETIC_DTYPES:  # float8: storage formats, no sums (gloo's nor torch's)
        raise ValueError(
            f"{what} {value} is a storage format that collectives cannot sum nor modules "
            "compute in; choose torch.float32, torch.bfloat16, torch.float16 or torch.float64"
        )
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
        warn_reduce(self.param_dtype, self.reduce_dtype, stacklevel=4)

    def resolved(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """``(param_dtype, reduce_dtype)`` with defaults filled in from the model's dtype."""
        param = self.param_dtype or model_dtype
        return param, self.reduce_dtype or param


def warn_reduce(
    param: torch.dtype | None, reduce: torch.dtype | None, *, stacklevel: int = 2
) -> None:
    """Warn when gradients computed in ``param`` are reduced in a ``reduce`` that loses them:
    narrower, or FP16 under BF16 (as wide, a far narrower range). Checked on the declared
    dtypes, and again by ``shard`` on the model's own dtype where ``param_dtype`` is None."""
    p, r = param, reduce
    if p is not None and r is not None and r.itemsize < p.itemsize:
        warnings.warn(
            f"reduce_dtype={r} is narrower than param_dtype={p}: gradients lose precision "
            "in communication; use reduce_dtype=None (same as param_dtype) or wider",
            stacklevel=stacklevel,
        )
    elif p == torch.bfloat16 and r == torch.float16:
        # (the same width: FP16's range, not its precision, is what is lost)
        warnings.warn(
            "reduce_dtype=torch.float16 under param_dtype=torch.bfloat16: FP16 has a far "
            "narrower range than BF16 (largest 65504; below 6e-8 a gradient is zero), and "
            "the default loss scale follows the parameters (none for BF16), so small "
            "gradients flush to zero in communication; reduce in FP32 or BF16, or pass "
            "loss_scaler=zeroshard.DynamicLossScaler() to zeroshard.optimizer",
            stacklevel=stacklevel,
        )


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
    key = name.lower().removeprefix("torch.") if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key in ("float64", "double", "fp64", torch.float64):
        raise ValueError(
            f"precision {name!r}: leave mixed_precision unset (None) to compute in the model's "
            "own dtypes (a float64 model trains in float64 on float64 masters)"
        )
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


class UnitPrecisionError(ValueError):
    """``shard(unit_precision=...)`` names modules that cannot compute in a policy of their own
    (tied, or read by their parent); ``reasons`` says why, one line per module, without advice
    (the command line gives its own)."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__(
            f"unit_precision cannot give these modules a policy of their own: "
            f"{'; '.join(reasons)}. Key the policy by the class of a module around every use "
            "(for a module its parent computes, the parent's class), untie the parameters, or "
            "leave the class out of unit_precision"
        )


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


def outputs_to_parents(
    names: list[str],
    modules: list[nn.Module],
    policies: list[MixedPrecision],
    default: MixedPrecision,
    given: Mapping[type | str, MixedPrecision | str] | None,
    overrides: Mapping[type | str, MixedPrecision],
    device: torch.device,
) -> list[MixedPrecision]:
    """The units' policies (``unit_policy``'s, one per unit ``names[i]`` / ``modules[i]``, the
    root first) with each unit's outputs given back in the dtype its enclosing unit computes
    in, where one of the two has a policy of its own (``unit_overrides`` decides per class, as
    if the parent were the model: FP32 norms inside FP32 blocks of a BF16 model gave the
    blocks' next layer BF16 inputs, "mat1 and mat2 must have the same dtype"). An
    ``output_dtype`` the caller named stays. Units given the same change share one policy
    object (units are bucketed by policy at stages 0-2)."""
    if not given:
        return policies
    named = {k: v for k, v in given.items() if policy_of(v, device).output_dtype is not None}
    model_dtype = default.param_dtype or _dtype_outside(modules[0], overrides)

    def computes_in(i: int) -> torch.dtype | None:
        if policies[i] is default:
            return model_dtype
        return policies[i].param_dtype or own_dtype(modules[i])

    out, made = list(policies), {}
    for i in range(1, len(names)):
        if _override_of(modules[i], named) is not None:
            continue
        parent = max(
            (j for j in range(len(names)) if j != i and _inside(names[i], names[j])),
            key=lambda j: len(names[j]),
        )  # the nearest enclosing unit (the root encloses all)
        if policies[i] is default and policies[parent] is default:
            continue  # (both compute in the model's dtype)
        want = computes_in(parent)
        output = None if want in (None, computes_in(i)) else want
        if output == policies[i].output_dtype:
            continue
        key = (id(policies[i]), output)
        if key not in made:
            made[key] = dataclasses.replace(policies[i], output_dtype=output)
        out[i] = made[key]
    return out


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def own_dtype(module: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def tf32_policy(
    units: list[tuple[str, list[torch.Tensor]]], policies: list[MixedPrecision]
) -> MixedPrecision | None:
    """The policy whose ``allow_tf32`` the model holds (``hold_tf32``): the first unit's that
    asks for TF32 (``units``: each unit's name and own parameters, beside its policy), None
    when none does. TF32 is one switch for the whole process and changes FP32 matmuls only (a
    head kept in TF32 under a BF16 model): refused where another unit computes matmuls in FP32
    without it (parameters of two dimensions or more, FP32 in its policy), which would run in
    TF32 too; norms and biases are not matmuls."""
    asking = next((i for i, policy in enumerate(policies) if policy.allow_tf32), None)
    if asking is None:
        return None
    for (name, params), policy in zip(units, policies):
        fp32_matmuls = not policy.allow_tf32 and any(
            p.dim() >= 2 and (policy.param_dtype or p.dtype) == _F32
            for p in params
            if p.is_floating_point()
        )
        if fp32_matmuls:
            raise ValueError(
                f"unit {units[asking][0] or '<root>'} asks for TF32, a switch torch holds for the "
                f"whole process, while unit {name or '<root>'} computes matmuls in FP32 without "
                "it: they would run in TF32 too. Give every FP32 part the same: 'tf32' for all "
                "of them (mixed_precision='tf32'), or none"
            )
    return policies[asking]


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


_TF32_LOCK = threading.RLock()
"""Re-entrant: a model's release is a finalizer, which the garbage collector may run on a thread
that holds the lock (an allocation inside ``hold_tf32`` while an earlier model is cyclic
garbage, a notebook cell sharding a model again); a plain lock blocked that thread for good."""
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
        _tf32_holders += 1  # (first: a release run in here by the garbage collector is another's)
        if _tf32_holders == 1:
            switches = _tf32_switches()
            _tf32_saved = [getattr(obj, attr) for obj, attr, _ in switches]
            for obj, attr, on in switches:
                setattr(obj, attr, on)
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
