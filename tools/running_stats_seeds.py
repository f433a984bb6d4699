"""running_mean / running_var after 5 training calls (no grad) against Model trained in float64,
ModelNew against eager Model (relative Frobenius errors), over 10 seeds (model and data), at
64 x 512 x 256 and 256 x 1024 x 512 on log-normal and uniform inputs; prints, per case, the
ratio of the mean errors over the seeds and the largest single-seed ratio (docs/perf.md v23),
and the signed bias of running_var: the mean over features and seeds of rv / rv_64 - 1 (a
GEMM whose truncating accumulation shrinks z shows as a negative bias; eager's is ~0).

    python tools/running_stats_seeds.py                        # default GEMM path
    FUSED_GEMM_BN_PORTABLE=1 python tools/running_stats_seeds.py
    python tools/running_stats_seeds.py --problem 33 --shape 64,512,256 --family lognormal --json out.json"""
import argparse
import copy
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new, reference  # noqa: E402
from level2_84_gemm_batchnorm_scaling_softmax import model_new as m84, reference as r84  # noqa: E402

SHAPES = [(64, 512, 256), (256, 1024, 512)]
FAMILIES = ["lognormal", "uniform"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bias(a, b):
    return (a.double() / b.double() - 1.0).mean().item()


def run_case(prob, m, k, n, fam, seeds, dev="cuda"):
    """{"rm": (eager errors, ModelNew errors), "rv": (...), "rv_bias": (...)} over the seeds, and the kernel path."""
    errs = {"rm": ([], []), "rv": ([], []), "rv_bias": ([], [])}
    path = None
    for seed in range(seeds):
        torch.manual_seed(seed)
        ref = (reference.Model(k, n, (n,)) if prob == "33" else r84.Model(k, n)).to(dev)
        new = (model_new.ModelNew(k, n, (n,)) if prob == "33" else m84.ModelNew(k, n)).to(dev)
        new.load_state_dict(ref.state_dict())
        r64 = copy.deepcopy(ref).double()
        g = torch.Generator(device=dev).manual_seed(100 + seed)
        with torch.no_grad():
            for _ in range(5):
                x = (torch.empty(m, k, device=dev).log_normal_(generator=g) if fam == "lognormal"
                     else torch.rand(m, k, device=dev, generator=g))
                ref(x), new(x), r64(x.double())
            path = new.kernel_path(x)  # the path the calls above took (no grad)
        for key, buf, fn in (("rm", "running_mean", rel), ("rv", "running_var", rel), ("rv_bias", "running_var", bias)):
            errs[key][0].append(fn(getattr(ref.bn, buf), getattr(r64.bn, buf)))
            errs[key][1].append(fn(getattr(new.bn, buf), getattr(r64.bn, buf)))
    return errs, path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problem", action="append", choices=("33", "84"), help="repeatable (default: both)")
    p.add_argument("--shape", action="append", help="M,K,N, repeatable (default: 64,512,256 and 256,1024,512)")
    p.add_argument("--family", action="append", choices=FAMILIES, help="repeatable (default: both)")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--json", help="also write the per-case summaries here")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs ModelNew's torch path (a smoke test)")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else SHAPES
    results = []
    for prob in args.problem or ["33", "84"]:
        for (m, k, n) in shapes:
            for fam in args.family or FAMILIES:
                errs, path = run_case(prob, m, k, n, fam, args.seeds, args.device)
                row = {"problem": prob, "shape": [m, k, n], "family": fam, "path": path}
                line = f"{prob} {m}x{k}x{n} {fam:9s} path {path}"
                for key in ("rm", "rv"):
                    e, nw = errs[key]
                    ratios = [b / a for a, b in zip(e, nw)]
                    row[key] = {"eager_mean": statistics.mean(e), "new_mean": statistics.mean(nw),
                                "ratio_of_means": statistics.mean(nw) / statistics.mean(e), "max_ratio": max(ratios)}
                    line += (f" | {key}: eager mean {statistics.mean(e):.2e} new mean {statistics.mean(nw):.2e} "
                             f"ratio of means {row[key]['ratio_of_means']:.2f} per-seed max {max(ratios):.2f}")
                e, nw = errs["rv_bias"]
                row["rv_bias"] = {"eager": statistics.mean(e), "new": statistics.mean(nw)}
                line += f" | rv bias: eager {statistics.mean(e):+.2e} new {statistics.mean(nw):+.2e}"
                results.append(row)
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
            json.dump({"device": device, "torch": torch.__version__, "seeds": args.seeds,
                       "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
