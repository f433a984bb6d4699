"""Problem 33's BatchNorm backward at the KernelBench shape (docs/perf.md v24): for one z and
one upstream gradient, the batch sum of dz per feature (zero in exact arithmetic) and the
coherent error sum_m (dz - dz64)[m, n] (x_m . mean(x)), which the weight gradient carries into
the next batch's mean; bn_backward_train against eager float32 autograd, float64, and
formula variants in torch; then the kernel's time (CUDA events).

    python tools/bn_backward_dz_sum.py      (on a GPU)"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"; M, K, N = 1024, 8192, 8192; eps = 1e-5
g_ = torch.Generator(device=dev).manual_seed(0)
x = torch.rand(M, K, device=dev, generator=g_)
W = (torch.rand(N, K, device=dev, generator=g_) * 2 - 1) / K ** 0.5
b = (torch.rand(N, device=dev, generator=g_) * 2 - 1) / K ** 0.5
s = torch.rand(N, device=dev, generator=g_) * 4 - 2
gamma = 1 + 0.1 * torch.randn(N, device=dev, generator=g_)
gy = torch.randn(M, N, device=dev, generator=g_) / M
z64 = x.double() @ W.double().t()
z = z64.float()
mu64 = z.double().mean(0); var64 = ((z.double() - mu64) ** 2).mean(0)
stats = torch.stack([mu64.float(), var64.float()])
xbar = x.double().mean(0); proj = x.double() @ xbar  # (M,) x_m . xbar
def report(name, dz, dz64):
    e = dz.double() - dz64
    colsum = dz.double().sum(0)
    coh = (e * proj[:, None]).sum(0)
    print(f"{name:28s} |sum_m dz| rms {colsum.pow(2).mean().sqrt().item():.3e} max {colsum.abs().max().item():.3e} | "
          f"coherent err rms {coh.pow(2).mean().sqrt().item():.3e} | dz maxrel {(e.abs().max() / dz64.abs().max()).item():.2e}", flush=True)
# exact
def eager(dtype):
    zz = z.to(dtype).clone().requires_grad_(True)
    u = (zz + b.to(dtype)) * s.to(dtype)
    y = torch.nn.functional.batch_norm(u, None, None, gamma.to(dtype), torch.zeros(N, device=dev, dtype=dtype), True, 0.1, eps)
    y.backward(gy.to(dtype))
    return zz.grad
dz64 = eager(torch.float64)
report("float64 (reference)", dz64, dz64)
report("eager float32", eager(torch.float32), dz64)
dzk = model_new._ext.bn_backward_train(gy, z, stats, s, gamma, eps, False, None)[0]
report("kernel", dzk, dz64)
dzt = model_new._torch_bn_backward_train(gy, z, stats, s, gamma, eps, False)[0]
report("torch-op twin", dzt, dz64)
# variant: exact batch mean (mu + S0/M) inside the formula
def variant(center_exact, round_once):
    mean = stats[0]; d = z - mean  # f32
    if center_exact:
        S0 = d.double().sum(0); d64 = d.double() - S0 / M
    else:
        d64 = d.double()
    sg = gy.double().sum(0); sgd = (gy.double() * d64).sum(0)
    r = torch.rsqrt(s.double() ** 2 * stats[1].double() + eps)
    a = s.double() * gamma.double() * r
    cd = s.double() ** 3 * gamma.double() * r ** 3 * sgd / M
    if round_once:
        return (gy.double() * a - a * sg / M - d64 * cd).float()
    return gy * a.float() - (a * sg / M).float() - d64.float() * cd.float()
report("variant: f32 rounded mu", variant(False, False), dz64)
report("variant: exact mean", variant(True, False), dz64)
report("variant: exact mean, 1 rounding", variant(True, True), dz64)
report("variant: f32 mu, 1 rounding", variant(False, True), dz64)
ts = []
for _ in range(25):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); model_new._ext.bn_backward_train(gy, z, stats, s, gamma, eps, False, None); e1.record(); e1.synchronize()
    ts.append(e0.elapsed_time(e1))
ts.sort(); print(f"bn_backward_train KB median {ts[len(ts)//2]*1e3:.1f} us (CUDA events, one call)")
