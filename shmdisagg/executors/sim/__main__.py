"""`python -m shmdisagg.executors.sim`; `main` is re-exported for `shmdisagg sim ...`."""

import sys

from shmdisagg.executors.sim.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
