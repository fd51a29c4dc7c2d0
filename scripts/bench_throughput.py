"""rlt-bench throughput from a checkout without installing: python scripts/bench_throughput.py [options].

The implementation is rlt_engine.bench.throughput (the console script `rlt-bench throughput` runs it).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlt_engine.bench.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
