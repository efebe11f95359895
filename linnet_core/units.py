"""Sizes and durations as people write and read them (`5GB`, `30d`), in one place for every command."""

from __future__ import annotations

import re

from .errors import InputError

_SIZES = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DURATIONS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB` or a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _SIZES:
        raise InputError(f"cannot read '{text}' as a size", hint="write it like 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _SIZES[m.group(2)])
    if size < 1:
        raise InputError(f"a size must be positive, got '{text}'")
    return size


def format_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `2w` or seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise InputError(f"cannot read '{text}' as a duration", hint="write it like 30d, 12h, 90m or 2w")
    return float(m.group(1)) * _DURATIONS[m.group(2) or "s"]


def format_age(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f}{unit} ago"
    return "just now"
