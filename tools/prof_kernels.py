"""Per-kernel CUDA time of ModelNew's forward (torch.profiler), median over 12 calls
on uniform inputs after 3 warm-up calls, under torch.no_grad (docs/perf.md's per-kernel rows),
in float32 or, with a fifth argument, float16 / bfloat16 (the module moved with .to(dtype)).
At small M the kernels launched early under programmatic dependent launch count their
wait for the kernel before them (perf.md v56): read those rows as upper bounds.

    python tools/prof_kernels.py M K N {33|84} {train|eval} [float32|float16|bfloat16]
    (from the repository root, on a GPU)"""
import statistics
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
m, k, n = (int(v) for v in sys.argv[1:4])
problem, mode = sys.argv[4], sys.argv[5]
if problem == "33":
    import model_new as mod
    model = mod.ModelNew(k, n, (n,)).cuda()
else:
    from level2_84_gemm_batchnorm_scaling_softmax import model_new as mod
    model = mod.ModelNew(k, n).cuda()
dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
    sys.argv[6] if len(sys.argv) > 6 else "float32"]
model = model.to(dtype).train(mode == "train")
xs = [torch.rand(m, k, device="cuda").to(dtype) for _ in range(3)]
with torch.no_grad():
    print(f"{problem} {mode} {m}x{k}x{n} {dtype}: {model.kernel_path(xs[0])}")
    for x in xs:
        model(x)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(12):
            model(xs[i % 3])
        torch.cuda.synchronize()
times = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        times.setdefault(e.name.split("(")[0].split("<")[0][-40:], []).append(e.device_time)
for name, ts in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
    print(f"  {name:<42s} {statistics.median(ts):9.1f} us  x{len(ts)}")
