"""pytest plugin for the GPU suite on a machine with several GPUs, with
pytest-xdist: each worker sees one GPU, round-robin over SPLIT_GPUS of them.

    SPLIT_GPUS=2 python -m pytest -q -p tests.gpu_split -n 8 -k "gpu or cuda"

Loaded with -p, it runs in each worker before torch initialises CUDA, so
CUDA_VISIBLE_DEVICES still takes effect.  Without SPLIT_GPUS, or outside an
xdist worker, it does nothing.  (Synchronized-BatchNorm tests on NCCL want both
GPUs in one process: run tools/sync_bn_gpu_check.py apart.)
"""
import os

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and os.environ.get("SPLIT_GPUS"):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % int(os.environ["SPLIT_GPUS"]))
