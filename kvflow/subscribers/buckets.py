"""Explicit histogram bucket boundaries, one set per unit.

The SDK's default boundaries (0 .. 10000) put every value in seconds or GB/s
into one or two buckets; each set here spans the range its unit really takes.
"""

from __future__ import annotations

#: Operation latency in seconds: 10 microseconds to 5 minutes.
OP_SECONDS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

#: Transfer rate in GB/s (1e9 bytes per second): 0.1 to 5000.
GB_PER_S: tuple[float, ...] = (
    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0,
    100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
)  # fmt: skip

#: GPU block ages in seconds (lifetime, idle, reuse gap): 1 ms to 1 day.
BLOCK_SECONDS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
)  # fmt: skip

#: Token counts per operation: powers of two from 16 to 1M tokens.
TOKENS: tuple[float, ...] = tuple(float(1 << k) for k in range(4, 21))
