"""Human-readable numbers for the terminal view and the report: durations, sizes, rates."""

from __future__ import annotations

_SIZES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def seconds(value: float | None) -> str:
    """A duration with a unit that keeps 3 significant digits (`-` for none)."""
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.3g} us"
    if value < 1.0:
        return f"{value * 1e3:.3g} ms"
    if value < 120.0:
        return f"{value:.3g} s"
    if value < 7200.0:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


def size(nbytes: float) -> str:
    """Bytes in binary units (the units of --l1-size-gb and --l2-disk-size-gb)."""
    for unit, scale in _SIZES:
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def rate(value: float) -> str:
    """A per-second count with 3 significant digits."""
    return f"{value:.3g}" if value else "0"


def gb_s(value: float) -> str:
    """GB/s (1e9 bytes/s) with 3 significant digits."""
    return f"{value:.3g} GB/s" if value else "0 GB/s"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def uptime(value: float) -> str:
    """H:MM:SS."""
    total = int(value)
    return f"{total // 3600}:{total // 60 % 60:02d}:{total % 60:02d}"


def bar(fraction: float, width: int = 24) -> str:
    """A text bar of `width` cells filled to `fraction` (clamped to [0, 1])."""
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "█" * filled + "░" * (width - filled)
