"""Where problem 33's running_mean error after SGD steps comes from (docs/perf.md, issue 20's
parity bar).  Model, ModelNew and Model in float64 trained side by side (five SGD steps, loss
sum(out * g) / M); per step and per model: the weight gradient's error against float64
gradients at that model's own weights (max-relative, and its coherent part err @ mean_m(x)),
the batch-mean error of v = x W^T + b at its own weights, the next batch mean's drift caused
by its weight and bias differences from the float64 model, and running_mean against it.

    python tools/running_mean_drift.py [LR]        # LR default 0.01; K = N = 8192, M = 1024 on CUDA
    DEV=cpu KN=64 MM=32 python tools/running_mean_drift.py 0.01   # a small CPU smoke run"""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new  # noqa: E402
import reference  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # Model in true float32
DEV = os.environ.get("DEV", "cuda")
K = N = int(os.environ.get("KN", 8192))
M = int(os.environ.get("MM", 1024))
LR = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
torch.manual_seed(0)
ref = reference.Model(K, N, (N,)); new = model_new.ModelNew(K, N, (N,))
gen = torch.Generator().manual_seed(1)
with torch.no_grad():
    ref.scale.copy_(torch.rand(ref.scale.shape, generator=gen) * 4 - 2)
new.load_state_dict(ref.state_dict())
ref64 = copy.deepcopy(ref).double().to(DEV); ref = ref.to(DEV); new = new.to(DEV)
opts = {n: torch.optim.SGD(m.parameters(), lr=LR) for n, m in (("ref", ref), ("new", new), ("ref64", ref64))}
def rel(a, b): return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
for step in range(5):
    g_ = torch.Generator().manual_seed(1000 + step)
    x = torch.rand(M, K, generator=g_); g = torch.randn(M, N, generator=g_)
    x, g = x.to(DEV), g.to(DEV)
    xbar = x.double().mean(0)
    line = [f"step {step}"]
    for name, m in (("ref", ref), ("new", new)):
        m64 = copy.deepcopy(m).double()
        with torch.no_grad():
            W64 = m64.gemm.weight; b64 = m64.gemm.bias
            vmean64 = ((x.double() @ W64.t() + b64) * m64.scale).mean(0)
        # forward batch-mean error: the running_mean update of this call, at the model's weights
        rm_before = m.bn.running_mean.clone()
        mom = m.bn.momentum
        out = m(x)
        vmean_model = (m.bn.running_mean.double() - (1 - mom) * rm_before.double()) / mom
        ((out * g).sum() / M).backward()
        out64 = m64(x.double()); ((out64 * g.double()).sum() / M).backward()
        gw, gw64 = m.gemm.weight.grad.double(), m64.gemm.weight.grad
        err = gw - gw64
        coh = err @ xbar; coh64 = gw64 @ xbar
        line.append(f"{name}: gW maxrel {rel(gw, gw64):.2e} coherent {coh.abs().max().item() / coh64.abs().max().item():.2e} "
                    f"mean(coh sign) {coh.sign().mean().item():+.3f} | batch mean_v err {rel(vmean_model, vmean64):.2e}")
        gb, gb64 = m.gemm.bias.grad.double(), m64.gemm.bias.grad
        line.append(f"{name}: grad gemm.bias max|.| {gb.abs().max().item():.2e} (f64 {gb64.abs().max().item():.2e}), "
                    f"mean over features {gb.mean().item():+.2e}")
        del m64
    out64 = ref64(x.double()); ((out64 * g.double()).sum() / M).backward()
    for o in opts.values(): o.step(); o.zero_grad(set_to_none=True)
    for name, m in (("ref", ref), ("new", new)):
        with torch.no_grad():
            dW = m.gemm.weight.double() - ref64.gemm.weight; db = m.gemm.bias.double() - ref64.gemm.bias
            A = (dW @ xbar) * ref64.scale; B = db * ref64.scale
            rm64 = ref64.bn.running_mean.abs().max().item()
        line.append(f"{name} next-batch mean drift / max|rm64|: weights {A.abs().max().item() / rm64:.2e} (mean {A.mean().item() / rm64:+.2e}), "
                    f"bias {B.abs().max().item() / rm64:.2e} (mean {B.mean().item() / rm64:+.2e})")
    line.append(f"running_mean vs f64: ref {rel(ref.bn.running_mean, ref64.bn.running_mean):.2e} new {rel(new.bn.running_mean, ref64.bn.running_mean):.2e}"
                f"  weight: ref {rel(ref.gemm.weight, ref64.gemm.weight):.2e} new {rel(new.gemm.weight, ref64.gemm.weight):.2e}")
    print("\n  ".join(line), flush=True)
