"""The values of ``zeroshard plan``'s flags, parsed and checked: counts and lists of them,
stages, offload placements, bytes per parameter and per activation element (or the precision
that sets both). Each raises a ValueError naming the flag and what it takes."""

from __future__ import annotations

from zeroshard.planner import memory
from zeroshard.planner.memory import OFFLOADS


def check_positive(name: str, value: int | None, low: int = 1) -> None:
    if value is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")


def ints(flag: str, text: str, *, low: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by commas, got {text!r}") from None
    for v in values:
        check_positive(flag, v, low)
    return values


PRECISION_BYTES = memory.PRECISION_BYTES


def state_bytes(args) -> tuple[memory.BytesPerParam, int]:
    """Bytes per parameter and per activation element: --precision's, or the explicit flags
    (ZeRO's 2,2,12 and 2 by default). --precision with either of them is a ValueError."""
    if args.precision is not None:
        flags = {"--bytes-per-param": args.bytes_per_param}
        flags["--activation-bytes"] = args.activation_bytes
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise ValueError(
                f"--precision {args.precision} sets {' and '.join(given)}: pass one or the other"
            )
        check_step_in_backward(args)
        return PRECISION_BYTES[args.precision]
    per_param = bytes_per_param(args.bytes_per_param or "zero")
    return per_param, args.activation_bytes or 2


def check_step_in_backward(args) -> None:
    """The engine's refusal (``model_states/backward_step.py``), before any work."""
    if args.precision == "fp16" and getattr(args, "step_in_backward", False):
        raise ValueError(
            "--step-in-backward cannot be combined with fp16's dynamic loss scaling, which "
            "must skip whole steps; plan bf16 or fp32, or drop --step-in-backward"
        )


def check_accumulate_unreduced(args, stages: tuple[int, ...]) -> None:
    """``--accumulate-unreduced`` where ``zeroshard train`` takes it: stages 2-3 (partitioned
    gradients; below, gradients are whole between micro-batches anyway) and two or more
    micro-batches. One of the stages planned is enough: the others' rows are as without it."""
    if not args.accumulate_unreduced:
        return
    if args.grad_accum < 2 or not any(s >= 2 for s in stages):
        raise ValueError(
            "--accumulate-unreduced needs stage 2 or 3 (partitioned gradients) and --grad-accum "
            f"2 or more, as zeroshard train does; got --stage {','.join(map(str, stages))} and "
            f"--grad-accum {args.grad_accum}: add those, or drop --accumulate-unreduced"
        )


def bytes_per_param(text: str) -> memory.BytesPerParam:
    if text in memory.BYTES_PER_PARAM_PRESETS:
        return memory.BYTES_PER_PARAM_PRESETS[text]
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"--bytes-per-param takes zero, infinity or PARAMS,GRADS,K such as 2,2,12; got {text!r}"
        )
    p, g, k = (int(v) for v in parts)
    if p not in (0, 1, 2, 4, 8) or g not in (0, 1, 2, 4, 8):
        raise ValueError(
            f"--bytes-per-param {text}: parameters and gradients take a dtype's width, 1, 2, 4 "
            f"or 8 bytes (0: not counted); got {p} and {g}"
        )
    try:
        return memory.BytesPerParam(params=p, grads=g, optimizer_states=k)
    except ValueError as exc:
        raise ValueError(f"--bytes-per-param {text}: {exc}") from None


def offloads(text: str) -> tuple[str, ...]:
    names = tuple(OFFLOADS) if text == "all" else tuple(n.strip() for n in text.split(","))
    for n in names:
        if n not in OFFLOADS:
            raise ValueError(f"unknown --offload {n!r}; choose all or from {', '.join(OFFLOADS)}")
    return names


def stages(text: str | None, step_in_backward: bool = False) -> tuple[int, ...]:
    if text is None:  # the default: every stage the configuration can have
        text = "2,3" if step_in_backward else "0,1,2,3"
    stages = ints("--stage", text, low=0)
    for s in stages:
        if s not in (0, 1, 2, 3):
            raise ValueError(f"--stage takes 0, 1, 2 or 3 (or a list such as 2,3), got {s}")
    low = [s for s in stages if s < 2]
    if step_in_backward and low:
        raise ValueError(
            f"--step-in-backward needs partitioned gradients (stage 2 or 3), but --stage has "
            f"{','.join(map(str, low))}; pass --stage 2,3 or drop --step-in-backward"
        )
    return tuple(dict.fromkeys(stages))  # (--stage 1,1 planned, and printed, a row twice)


def opt(parse, args, dest: str):
    """``args.<dest>`` read by ``parse`` (None when not given); a value it refuses is an error
    naming the flag (``--bucket: memory size must be a positive size, got '0'``)."""
    text = getattr(args, dest)
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"--{dest.replace('_', '-')}: {exc}") from None


def fraction(flag: str, value: float) -> float:
    """A fraction in [0, 1), or an error naming ``flag``."""
    if not 0 <= value < 1:
        raise ValueError(f"{flag} is a fraction in [0, 1), got {value}")
    return value
