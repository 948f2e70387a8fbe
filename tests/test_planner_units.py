"""Sizes, rates, FLOP/s and counts as people write them, read back exactly."""

import pytest

from zeroshard.planner.units import (
    format_bytes,
    format_rate,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    parse_flops,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80 GB", 80 * 10**9),
        ("1.5TB", 15 * 10**11),
        ("512MiB", 512 * 2**20),
        ("25kB", 25_000),
        ("4096", 4096),
        ("4096B", 4096),
        ("2TiB", 2 * 2**40),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_gb_and_gib_are_told_apart():
    assert parse_bytes("80GiB") - parse_bytes("80GB") == 80 * 2**30 - 80 * 10**9
    assert parse_bytes("80GB") != parse_bytes("80GiB")


@pytest.mark.parametrize("text", ["80GX", "80 parsecs", "GB", "", "80GB/s", "1e3XB"])
def test_unknown_unit_rejected(text):
    with pytest.raises(ValueError, match="cannot read memory size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0GB", "0", "-5GB", "-1"])
def test_zero_or_negative_size_rejected(text):
    with pytest.raises(ValueError, match="positive"):
        parse_bytes(text)


def test_bits_are_not_bytes():
    with pytest.raises(ValueError, match="bits"):
        parse_bytes("80Gb")
    with pytest.raises(ValueError, match="12.5GB/s"):
        parse_bandwidth("100Gb/s")


def test_not_a_string():
    with pytest.raises(TypeError):
        parse_bytes(80)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("70GB/s", 70e9),
        ("1.5TB/s", 1.5e12),
        ("25GiB/s", 25 * 2**30),
        ("100MBps", 1e8),
        # A plain number is bytes/s: the unit is optional.
        ("70000000000", 70e9),
        ("7e10", 70e9),
        ("1.5", 1.5),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == expected


def test_bandwidth_needs_per_second():
    # With a prefix or a unit, "/s" says it is a rate: "70GB" is a size.
    with pytest.raises(ValueError, match="70GB/s"):
        parse_bandwidth("70GB")
    with pytest.raises(ValueError, match="70GB/s"):
        parse_bandwidth("70G")


@pytest.mark.parametrize("text", ["0", "-7e10", "nan", "inf"])
def test_plain_bandwidth_must_be_positive(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text", ["70TFLOP/s", "70TFLOPS", "70 tflops", "70T", "7e13"])
def test_parse_flops(text):
    assert parse_flops(text) == 70e12


def test_parse_flops_rejects():
    for bad in ("fast", "0T", "70TB/s"):
        with pytest.raises(ValueError):
            parse_flops(bad)


@pytest.mark.parametrize(
    "text, expected",
    [("7.5B", 7_500_000_000), ("7.5e9", 7_500_000_000), ("350M", 350_000_000), ("1200", 1200)],
)
def test_parse_count(text, expected):
    assert parse_count(text) == expected


def test_parse_count_rejects():
    for bad in ("0", "-3", "7.5X", "many"):
        with pytest.raises(ValueError):
            parse_count(bad)


def test_format_three_significant_digits():
    assert format_bytes(120e9) == "120 GB"
    assert format_bytes(31.40625e9) == "31.4 GB"
    assert format_bytes(16.640625e9) == "16.6 GB"
    assert format_bytes(1.875e9) == "1.88 GB"
    assert format_bytes(2**30, "GiB") == "1 GiB"
    assert format_rate(1.2305e12) == "1.23 TB/s"
    assert format_rate(356e6) == "356 MB/s"


def test_decimal_counts_and_sizes_are_read_exactly():
    """In floats 4.1 * 1e9 is 4099999999.9999995: "4.1B" was "not a whole number of elements"
    (72 of "0.1K" ... "99.9B"), and "8.3MB" 8300001 bytes once rounded up."""
    from fractions import Fraction

    for whole in range(1, 1000):
        for prefix, scale in (("K", 10**3), ("M", 10**6), ("B", 10**9)):
            text = f"{whole / 10:g}{prefix}"
            assert parse_count(text) == Fraction(text[:-1]) * scale, text
    assert parse_bytes("8.3MB") == 8_300_000 and parse_bytes("16.1MB") == 16_100_000


def test_a_value_rounding_up_to_the_next_unit_is_written_in_it():
    assert format_rate(999.6e9) == "1 TB/s"  # (was "1e+03 GB/s")
    assert format_bytes(999.5, "B") == "1,000 B"
