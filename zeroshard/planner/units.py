"""Sizes written by people ("80GB", "80GiB", "1.5TB/s", "70TFLOP/s", "7.5B") turned into plain
numbers, and back. The planner computes in bytes, bytes/s, FLOP/s and element counts; only the CLI
edge calls these parsers. A plain number ("70000000000", "7e10") is in that base unit.

Decimal prefixes are powers of 1000 (GB = 1e9 bytes, as the ZeRO papers count), binary prefixes
powers of 1024 (GiB = 2**30 bytes): "80GB" and "80GiB" are different sizes. A lowercase "b" means
bits and is rejected rather than silently misread as bytes.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
# Counts of things (parameters): K, M, B (billion, as in "7.5B parameters"), T.
COUNT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
_SIZE = re.compile(_NUMBER + r"(?P<prefix>[kKmMgGtTpP]i?)?(?P<unit>[bB])?$")
_RATE = re.compile(_NUMBER + r"(?P<prefix>[kKmMgGtTpP]i?)?(?P<unit>[bB])?\s*(?:/\s*s|ps)$")
_FLOPS = re.compile(_NUMBER + r"(?P<prefix>[kKmMgGtTpP])?\s*(?P<unit>flop/s|flops|flop)?$", re.I)
_PLAIN = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?")
_UNIT = re.compile(r"(?:[kKmMgGtTpP]i?)?B")
_COUNT = re.compile(_NUMBER + r"(?P<prefix>[kKmMbBgGtT])?$")


def _scale(prefix: str | None) -> int:
    prefix = (prefix or "").lower()
    return BINARY[prefix] if prefix.endswith("i") else DECIMAL[prefix]


def _not_negative(text: str, what: str) -> None:
    if text.strip().startswith("-"):
        raise ValueError(f"{what} must be positive, got {text!r}")


def _exact(match: re.Match, scale: int, text: str, what: str) -> Fraction:
    """The number ``match`` read times ``scale``, exactly (4.1 * 1e9 in floats is
    4099999999.9999995: not a whole count, and one byte more once rounded up)."""
    value = Fraction(match["num"]) * scale
    try:
        _check(float(value), text, what)
    except OverflowError:
        raise ValueError(f"{what} must be finite, got {text!r} (beyond a float's range)") from None
    return value


def _check(value: float, text: str, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {text!r} (beyond a float's range)")
    if value <= 0:
        raise ValueError(f"{what} must be a positive size, got {text!r}")
    return value


def _sized(pattern: re.Pattern, text: str, what: str, example: str) -> Fraction:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string such as {example!r}, got {type(text).__name__}")
    _not_negative(text, what)
    match = pattern.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"cannot read {what} {text!r}; write a number and a unit such as {example!r} "
            "(decimal kB/MB/GB/TB = 1000**n bytes, binary KiB/MiB/GiB/TiB = 1024**n bytes)"
        )
    if match["unit"] == "b":
        raise ValueError(
            f"{what} {text!r} is in bits (lowercase b); write bytes with an uppercase B, "
            "e.g. 100Gb/s is 12.5GB/s"
        )
    return _exact(match, _scale(match["prefix"]), text, what)


def parse_bytes(text: str) -> int:
    """Bytes in ``"80GB"`` (80e9), ``"80GiB"`` (80 * 2**30), ``"512MiB"``, ``"4096"`` (bytes)."""
    return math.ceil(_sized(_SIZE, text, "memory size", "80GB"))


def parse_bandwidth(text: str) -> float:
    """Bytes per second in ``"70GB/s"``, ``"1.5TB/s"``, ``"25GiB/s"``, or a plain number of
    bytes/s (``"70000000000"``, ``"7e10"``). With a prefix or a unit the ``/s`` is
    required: ``"70GB"`` is a size, not a rate."""
    if isinstance(text, str) and _PLAIN.fullmatch(text.strip()):
        _not_negative(text, "bandwidth")
        return _check(float(text), text, "bandwidth")
    return float(_sized(_RATE, text, "bandwidth", "70GB/s"))


def parse_flops(text: str) -> float:
    """FLOP/s in ``"70TFLOP/s"``, ``"70TFLOPS"``, ``"70T"`` or ``"7e13"``."""
    if not isinstance(text, str):
        raise TypeError(f"peak FLOP/s must be a string such as '70TFLOP/s', got {text!r}")
    _not_negative(text, "peak FLOP/s")
    match = _FLOPS.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"cannot read peak FLOP/s {text!r}; write e.g. '70TFLOP/s' or '7e13'")
    return _check(float(match["num"]) * _scale(match["prefix"]), text, "peak FLOP/s")


def parse_count(text: str) -> int:
    """A count of elements: ``"7.5B"`` or ``"7.5e9"`` (7.5e9), ``"350M"``, ``"1200"``."""
    if not isinstance(text, str):
        raise TypeError(f"a count must be a string such as '7.5B', got {text!r}")
    _not_negative(text, "a count")
    match = _COUNT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"cannot read count {text!r}; write e.g. '7.5B', '350M' or '1.2e9'")
    value = _exact(match, COUNT[(match["prefix"] or "").lower()], text, "a count")
    if value.denominator != 1:
        raise ValueError(f"count {text!r} is not a whole number of elements")
    return int(value)


def format_bytes(num_bytes: float, unit: str = "GB") -> str:
    """``num_bytes`` in ``unit`` with three significant digits: 31.40625e9 -> ``"31.4 GB"``."""
    if not isinstance(unit, str) or not _UNIT.fullmatch(unit):  # ("2GB" read as 12e9 bytes)
        raise ValueError(
            f"unit {unit!r} is not a unit of bytes: write one such as GB, GiB, MB or B, with no "
            "number (decimal kB/MB/GB/TB = 1000**n bytes, binary KiB/MiB/GiB/TiB = 1024**n)"
        )
    scale = float(_sized(_SIZE, f"1{unit}", "unit", "GB"))
    value = num_bytes / scale
    text = f"{value:.3g}" if abs(float(f"{value:.3g}")) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}"


def format_rate(bytes_per_s: float) -> str:
    """A bandwidth in the decimal unit that keeps it readable: 1.2305e12 -> ``"1.23 TB/s"``."""
    rounded = float(f"{bytes_per_s:.3g}")  # (999.6e9 is 1 TB/s, not "1e+03 GB/s")
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rounded >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}/s"
    return f"{bytes_per_s:.3g} B/s"
