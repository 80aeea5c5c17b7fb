"""`shmdisagg stats`: a read-only, live view of a running deployment's shared memory.

| module | purpose |
|---|---|
| `snapshot.py` | `StatsReader` (read-only mappings, one `sample()`), `snapshot(prev, cur)` -> the JSON dict |
| `view.py` | the rich renderables of a snapshot |
| `cli.py` | options, `--once --json`, the `Live` loop |
"""
