"""Human forms of the raw numbers the wire carries (bytes, seconds, rates)."""

from __future__ import annotations

import math
from typing import Any

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def knob_text(value: Any) -> str:
    """A knob value as a person reads it: booleans as ``on`` / ``off``, the rest as is."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def human_bytes(value_bytes: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if value_bytes is None:
        return "-"
    value = float(value_bytes)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_bytes_pair(used_bytes: float | None, total_bytes: float | None) -> str:
    """Used and total in the total's unit: ``"3.0/16.0 GiB"``; ``"-"`` for None."""
    if used_bytes is None or total_bytes is None:
        return f"{human_bytes(used_bytes)}/{human_bytes(total_bytes)}"
    total = human_bytes(total_bytes)
    number, unit = total.split(" ")
    scale = 1024 ** _BYTE_UNITS.index(unit)
    return f"{used_bytes / scale:.{0 if unit == 'B' else 1}f}/{number} {unit}"


def human_age(age_s: float) -> str:
    """A duration in seconds as ``"42s"``, ``"3m05s"`` or ``"2h07m"``."""
    total = max(0, int(age_s))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def human_ms(value_s: float | None) -> str:
    """Seconds as milliseconds: ``0.0123`` -> ``"12.3 ms"``; None -> ``"-"``."""
    if value_s is None or not math.isfinite(value_s):
        return "-"
    return f"{value_s * 1e3:.1f} ms"


def human_number(value: float | None, digits: int = 0) -> str:
    """A number with thousands separators (``12,345.6``); None or non-finite -> ``"-"``."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"
