"""Observability: per-request counters in shared memory, the Prometheus scrape, per-request
perf records joined with the executors' own. See README.md in this folder.

Import the submodules directly; this package imports nothing so that `shmdisagg stats` stays
light."""
