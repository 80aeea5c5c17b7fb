"""`python -m shmdisagg.bench`: the bench command without the top-level CLI."""

import sys

from shmdisagg.bench.cli import main

raise SystemExit(main(sys.argv[1:]))
