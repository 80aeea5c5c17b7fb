"""The chaos suite's harness: a deployment on the simulator (`deploy.py`), sustained mixed load
from an asyncio client (`client.py`, `load.py`), the faults (`faults.py`), the invariants checked
after each scenario (`checks.py`) and the session's table (`report.py`). The scenarios are in
`tests/stress/test_chaos.py`."""
