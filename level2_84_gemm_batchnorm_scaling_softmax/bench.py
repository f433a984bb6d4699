"""Benchmark entry for problem 84: the repository's bench.py with --model 84.

    python level2_84_gemm_batchnorm_scaling_softmax/bench.py [bench.py options]

Every option of ../bench.py applies (--shape, --mode, --iters, --sweep, ...).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench.main(["--model", "84"] + sys.argv[1:]))
