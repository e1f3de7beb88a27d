"""Applications that run kvflow on synthetic work: `kvflow demo` and `kvflow bench`.

`workload` makes multi-turn chat and document Q&A requests with shared prefixes,
`sim` plays an engine serving them through a `CacheEngine`, `tally` counts what the
event stream saw, `tiers` sizes L1 against the workload and lays out the per-tier
rows, and `app` prints the summary. `bench` runs a benchmark script from
a source checkout. Nothing in the engine or the tiers imports this package.
"""
