"""Numbers as a person reads them: one helper for every measured number, over the
magnitudes a run produces (microseconds to hours, 1e-13 to 1e9)."""

from __future__ import annotations

import math

import pytest

from gpuwatch.units import (counted, human_bytes_pair, human_duration, human_ms, human_rate,
                            human_sig, knob_text)


@pytest.mark.parametrize("value, text", [
    (0, "0"), (1e-13, "0"), (0.0003, "0.000300"), (0.000123456, "0.000123"),
    (0.0123, "0.0123"), (1, "1.00"), (2.0391, "2.04"), (-0.5, "-0.500"), (99.96, "100"),
    (288.0, "288"), (999.6, "1,000"), (1234.5, "1,234"), (11234.5, "11,234"),
    (89123.4, "89,123"), (1.2e9, "1,200,000,000"), (None, "-"), (math.nan, "-"),
    (math.inf, "-")])
def test_human_sig_has_three_significant_digits_and_separators(value, text):
    assert human_sig(value) == text


@pytest.mark.parametrize("value_s, text", [
    (1e-5, "0.0100 ms"), (0.000312, "0.312 ms"), (0.0123, "12.3 ms"), (0.2884, "288 ms"),
    (0.9996, "1.00 s"), (11.2, "11.2 s"), (84, "1.40 min"), (150, "2.50 min"),
    (7200, "2.00 h"), (None, "-")])
def test_human_duration_picks_the_unit(value_s, text):
    assert human_duration(value_s) == text == human_ms(value_s)


@pytest.mark.parametrize("used, total, text", [
    (6 * 2**30, 16 * 2**30, "6.0/16.0 GiB"), (462 * 2**20, 16 * 2**30, "0.45/16.0 GiB"),
    (48 * 2**20, 16 * 2**30, "0.047/16.0 GiB"), (0, 16 * 2**30, "0.0/16.0 GiB"),
    (100, 1000, "100/1000 B"), (None, 2**30, "-/1.0 GiB")])
def test_memory_used_of_a_total_keeps_two_significant_digits(used, total, text):
    # 462 MiB of 16 GiB once read "0.5/16.0 GiB": one significant digit
    assert human_bytes_pair(used, total) == text


def test_no_magnitude_is_written_in_scientific_notation():
    for exponent in range(-12, 13):
        for mantissa in (1.0, 1.234, 9.999):
            for sign in (1, -1):
                value = sign * mantissa * 10.0 ** exponent
                for text in (human_sig(value), human_duration(abs(value))):
                    assert "e" not in text.replace("min", "").replace(" ", ""), (value, text)
                    assert "E" not in text, (value, text)


@pytest.mark.parametrize("count, text", [(0, "0 runs"), (1, "1 run"), (2, "2 runs"),
                                         (1200, "1,200 runs")])
def test_counts_take_the_plural_they_need(count, text):
    assert counted(count, "run") == text


@pytest.mark.parametrize("value, text", [(0.05000000000000001, "0.05"), (0.2, "0.2"),
                                         (0.20000000000000004, "0.2"), (1e-05, "1e-05"),
                                         (3.0, "3.0"), (4, "4"), (True, "on"),
                                         ("bf16", "bf16"), (math.inf, "inf")])
def test_knob_values_read_without_float_noise(value, text):
    assert knob_text(value) == text


def test_a_throughput_of_0_is_unknown_not_measured_as_0():
    """A step trains on a sample at least: 0 samples/s says nothing counted them (a
    monitoring-only session)."""
    assert human_rate(0.0, "samples/s") == "unknown samples/s"
    assert human_rate(None, "samples/s") == "- samples/s"
    assert human_rate(109.2, "samples/s") == "109 samples/s"
    assert human_rate(0) == "unknown"
