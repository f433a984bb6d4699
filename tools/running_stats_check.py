"""running_mean / running_var after 5 training calls (one seed) against Model in float64,
ModelNew against eager Model, both problems, four shapes, five input families (docs/perf.md v21).

    python tools/running_stats_check.py      (prints a table; on a GPU)"""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new  # noqa: E402
import reference  # noqa: E402
from level2_84_gemm_batchnorm_scaling_softmax import model_new as m84  # noqa: E402
from level2_84_gemm_batchnorm_scaling_softmax import reference as r84  # noqa: E402

dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def draw(fam, m, k, g):
    if fam == "uniform":
        return torch.rand(m, k, device=dev, generator=g)
    if fam == "normal":
        return torch.randn(m, k, device=dev, generator=g)
    if fam == "100+u":
        return 100 + torch.rand(m, k, device=dev, generator=g)
    if fam == "exp":
        return torch.empty(m, k, device=dev).exponential_(generator=g)
    if fam == "lognormal":
        return torch.empty(m, k, device=dev).log_normal_(generator=g)
    raise ValueError(fam)


worst = {}
for prob in ["33", "84"]:
    for (m, k, n) in [(1024, 8192, 8192), (256, 1024, 512), (4096, 4096, 4096), (64, 512, 256)]:
        for fam in ["uniform", "normal", "100+u", "exp", "lognormal"]:
            torch.manual_seed(0)
            ref = (reference.Model(k, n, (n,)) if prob == "33" else r84.Model(k, n)).to(dev)
            new = (model_new.ModelNew(k, n, (n,)) if prob == "33" else m84.ModelNew(k, n)).to(dev)
            new.load_state_dict(ref.state_dict())
            r64 = copy.deepcopy(ref).double()
            g = torch.Generator(device=dev).manual_seed(5)
            with torch.no_grad():
                for _ in range(5):
                    x = draw(fam, m, k, g)
                    ref(x), new(x), r64(x.double())
            e = [rel(getattr(mm.bn, b), getattr(r64.bn, b)) for b in ("running_mean", "running_var") for mm in (ref, new)]
            rm_ratio, rv_ratio = e[1] / e[0], e[3] / e[2]
            worst[prob] = max(worst.get(prob, 0), rm_ratio, rv_ratio)
            print(f"{prob} {m}x{k}x{n} {fam:9s} running_mean eager {e[0]:.2e} new {e[1]:.2e} ({rm_ratio:.2f}x) | "
                  f"running_var eager {e[2]:.2e} new {e[3]:.2e} ({rv_ratio:.2f}x)", flush=True)
print("worst ratio per problem:", worst)
