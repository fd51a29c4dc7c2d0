"""Thin wrapper: `python scripts/bench_ipc.py …` is `rlt-bench ipc …`."""

import sys

from rlt_engine.bench.ipc import main

if __name__ == "__main__":
    sys.exit(main())
