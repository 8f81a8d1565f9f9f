"""Human forms of the raw numbers the wire carries (bytes, seconds, rates), and of paths."""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
#: Decimals :func:`human_sig` writes at most (smaller numbers read as ``0``).
_MAX_DECIMALS = 12
#: (unit, seconds per unit, how many of it make the next unit).
_DURATION_UNITS = (("ms", 1e-3, 1000.0), ("s", 1.0, 60.0), ("min", 60.0, 60.0),
                   ("h", 3600.0, math.inf))
#: An absolute path in a text: from a ``/`` that starts a word to the next space.
_PATH = re.compile(r"(?<!\S)/[^\s]*[^\s.,;:)]")


def knob_text(value: Any) -> str:
    """A knob value as a person reads it.

    Booleans as ``on`` / ``off``, floats in their shortest form to 12 significant digits
    (``0.05000000000000001`` -> ``0.05``, the noise of a run's own arithmetic), the rest as
    is."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and math.isfinite(value):
        return str(float(f"{value:.12g}"))
    return str(value)


def local_time(t_s: float | None, form: str = "%Y-%m-%d %H:%M:%S") -> str:
    """Unix time ``t_s`` (s) as local time in ``form`` (:func:`time.strftime`).

    ``"-"`` for None and for a time the platform cannot hold (a damaged log's ``1e308``)."""
    if t_s is None:
        return "-"
    try:
        return time.strftime(form, time.localtime(t_s))
    except (OverflowError, OSError, ValueError):
        return "-"


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
    """Used and total in the total's unit, used with two significant digits at least.

    For example ``"3.0/16.0 GiB"``, ``"0.45/16.0 GiB"``; ``"-"`` for None."""
    if used_bytes is None or total_bytes is None:
        return f"{human_bytes(used_bytes)}/{human_bytes(total_bytes)}"
    total = human_bytes(total_bytes)
    number, unit = total.split(" ")
    used = used_bytes / 1024 ** _BYTE_UNITS.index(unit)
    text = f"{used:.0f}" if unit == "B" else (
        f"{used:.1f}" if abs(used) >= 1 or used == 0 else human_sig(used, 2))
    return f"{text}/{number} {unit}"


def human_age(age_s: float) -> str:
    """A duration in seconds as ``"42s"``, ``"3m05s"`` or ``"2h07m"``."""
    total = max(0, int(age_s))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def human_sig(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits, as a person reads it on the dashboard.

    Never in scientific notation, with thousands separators: ``2.0391`` -> ``"2.04"``,
    ``11234.5``
    -> ``"11,234"`` (a number of ``digits`` or more integer digits keeps them all), ``0.0003`` ->
    ``"0.000300"``; None or non-finite -> ``"-"``. The one form of every measured number a person
    reads on the dashboard (step times, loss, rates, norms)."""
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = min(max(digits - 1 - magnitude, 0), _MAX_DECIMALS)
    text = f"{value:,.{decimals}f}"
    if decimals and float(text.replace(",", "")) != 0 and \
            math.floor(math.log10(abs(float(text.replace(",", ""))))) > magnitude:
        text = f"{value:,.{decimals - 1}f}"  # rounding carried a digit: 9.995 -> 10.0
    return "0" if float(text.replace(",", "")) == 0 else text


def human_duration(value_s: float | None) -> str:
    """A duration in seconds with 3 significant digits in the unit that reads best.

    ``0.0123`` -> ``"12.3 ms"``, ``11.2`` -> ``"11.2 s"``, ``150`` -> ``"2.50 min"``,
    ``7200`` -> ``"2.00 h"``; None or non-finite -> ``"-"``."""
    if value_s is None or isinstance(value_s, bool) or not math.isfinite(value_s):
        return "-"
    for unit, scale, next_unit in _DURATION_UNITS:
        text = human_sig(value_s / scale)
        if abs(float(text.replace(",", ""))) < next_unit:  # as written: 999.6 ms is 1.00 s
            break
    return f"{text} {unit}"


def human_ms(value_s: float | None) -> str:
    """Seconds as a person reads them (see :func:`human_duration`).

    ``0.0123`` ->
    ``"12.3 ms"``, ``11.2`` -> ``"11.2 s"``; None -> ``"-"``."""
    return human_duration(value_s)


def human_rate(value: float | None, unit: str = "") -> str:
    """A throughput as a person reads it (:func:`human_sig`, then `` unit``).

    ``0`` is ``unknown`` (a step trains on a sample at least: 0 says that nothing counted
    its batches, as in a monitoring-only session), None or non-finite ``-``."""
    if value == 0:
        text = "unknown"
    else:
        text = human_sig(value)
    return f"{text} {unit}" if unit else text


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun`` in the plural it takes.

    ``1 step``, ``0 steps``, ``1,200 steps`` (English nouns whose plural adds ``s``)."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def human_number(value: float | None, digits: int = 0) -> str:
    """A number with thousands separators (``12,345.6``); None or non-finite -> ``"-"``."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


def fit_paths(text: str, width: int) -> str:
    """``text`` with its absolute paths shortened from the middle, to fit ``width`` columns.

    Or at least so that the first path's file name ends within them. A file name is
    never cut: the home directory first reads ``~``, then a path's middle directories
    go, one at a time, longest path first (``/a/b/c/d/step-9.pt``: ``~/…/d/step-9.pt``,
    then ``…/step-9.pt``), until the text fits; if the path that crosses ``width`` still
    ends beyond it, the words before it are cut, at a word's end (``… `` marks where: a
    newcomer read "saved after step 36…" for step 360). What is still too
    long is the caller's to cut at its end. Costs O(len(text) x directories)."""
    if len(text) <= width:
        return text
    home = os.path.expanduser("~").rstrip("/")
    pieces: list[str] = []  # the text between paths, then a path's parts, in turn
    paths: list[list[str]] = []
    start = 0
    for match in _PATH.finditer(text):
        path = match.group()
        if home and (path == home or path.startswith(home + "/")):
            path = "~" + path[len(home):]
        pieces.append(text[start:match.start()])
        paths.append(path.split("/"))
        start = match.end()
    pieces.append(text[start:])

    def joined() -> str:
        return "".join(piece + ("/".join(paths[index]) if index < len(paths) else "")
                       for index, piece in enumerate(pieces))

    while len(joined()) > width:
        shrinkable = [parts for parts in paths if len(parts) > 2]
        if not shrinkable:
            break
        parts = max(shrinkable, key=lambda parts: len("/".join(parts)))
        if len(parts) == 3:
            parts[:-1] = ["…"]  # its file name alone
        elif parts[1] == "…":
            del parts[2]  # the directory after the "…"
        else:
            parts[1:3] = ["…"]
    end = 0
    for index, parts in enumerate(paths):  # the first path that ends beyond width
        before, path = pieces[index], "/".join(parts)
        # (a text cut after the path takes its last column for the caller's "…")
        limit = width - (1 if len(joined()) > width else 0)
        if end + len(before) + len(path) > limit:
            room = limit - end - len(path) - 2
            if room >= 0 and len(before) > room:
                cut = before[:room + 1]  # (a space just past the room ends a word)
                cut = cut[:cut.rfind(" ")] if " " in cut.strip() else before[:room]
                pieces[index] = cut.rstrip() + "… "  # (never a number cut: "step 36…")
            break
        end += len(before) + len(path)
    return joined()
