"""running_mean / running_var after 5 training calls (no grad) against Model trained in float64,
ModelNew against eager Model (relative Frobenius errors), over 10 seeds (model and data), at
64 x 512 x 256 and 256 x 1024 x 512 on log-normal and uniform inputs; prints, per case, the
ratio of the mean errors over the seeds and the largest single-seed ratio (docs/perf.md v23).

    python tools/running_stats_seeds.py                        # default GEMM path
    FUSED_GEMM_BN_PORTABLE=1 python tools/running_stats_seeds.py"""
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new, reference
from level2_84_gemm_batchnorm_scaling_softmax import model_new as m84, reference as r84
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
for prob in ["33", "84"]:
    for (m, k, n) in [(64, 512, 256), (256, 1024, 512)]:
        for fam in ["lognormal", "uniform"]:
            errs = {"rm": ([], []), "rv": ([], [])}
            for seed in range(10):
                torch.manual_seed(seed)
                ref = (reference.Model(k, n, (n,)) if prob == "33" else r84.Model(k, n)).to(dev)
                new = (model_new.ModelNew(k, n, (n,)) if prob == "33" else m84.ModelNew(k, n)).to(dev)
                new.load_state_dict(ref.state_dict()); r64 = copy.deepcopy(ref).double()
                g = torch.Generator(device=dev).manual_seed(100 + seed)
                with torch.no_grad():
                    for _ in range(5):
                        x = torch.empty(m, k, device=dev).log_normal_(generator=g) if fam == "lognormal" else torch.rand(m, k, device=dev, generator=g)
                        ref(x); new(x); r64(x.double())
                for key, buf in (("rm", "running_mean"), ("rv", "running_var")):
                    errs[key][0].append(rel(getattr(ref.bn, buf), getattr(r64.bn, buf)))
                    errs[key][1].append(rel(getattr(new.bn, buf), getattr(r64.bn, buf)))
            line = f"{prob} {m}x{k}x{n} {fam:9s} path {new.kernel_path(x)}"
            for key in ("rm", "rv"):
                e, nw = errs[key]
                ratios = [b / a for a, b in zip(e, nw)]
                line += (f" | {key}: eager mean {statistics.mean(e):.2e} new mean {statistics.mean(nw):.2e} "
                         f"ratio of means {statistics.mean(nw) / statistics.mean(e):.2f} per-seed max {max(ratios):.2f}")
            print(line, flush=True)
