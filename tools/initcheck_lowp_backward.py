"""compute-sanitizer workload for the 16-bit training step's own kernels alone:
kernels/lowp/'s forward_train_saved (the GEMM with its z store, the fold, the
apply / row softmax), then bn_backward_train and bn_backward_eval (the latter on
the same z and coefficients) with the scale per feature, of one number (shape
(1)) and one number viewed as (N) (those two: the scale-terms sum,
kernels/scale_terms.cuh), called through the 16-bit extension
for both problems, both 16-bit dtypes, the 16-bit module's form (16-bit vectors)
and the autocast form (float32 vectors), at the small shapes of
tools/sanitize_workload.py.  No cuBLAS product runs, so initcheck sees every
store (tools/sanitize_workload.py's docstring says why its 16-bit backward
calls cannot be checked with initcheck).  Exit code 0 when every output is finite.

    compute-sanitizer --tool initcheck --error-exitcode 1 python tools/initcheck_lowp_backward.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/initcheck_lowp_backward.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new  # noqa: E402
from tools.sanitize_workload import SMALL_SHAPES  # noqa: E402


def main():
    ext = model_new._LOWP.kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in SMALL_SHAPES:
        for dtype in (torch.float16, torch.bfloat16):
            for vec_dtype in (dtype, torch.float32):
                for scale_after_bn in (False, True):
                    x = torch.rand(m, k, device="cuda", generator=gen).to(dtype)
                    w = (torch.rand(n, k, device="cuda", generator=gen) - 0.5).to(dtype)
                    vecs = [torch.rand(n, device="cuda", generator=gen).to(vec_dtype) + 0.5 for _ in range(4)]
                    # one scale value at every feature: the per-feature forward's statistics hold for the
                    # one-number backward calls too (a mismatch can overflow the 16-bit one-number sum)
                    vecs[1] = vecs[1][:1].expand(n).contiguous()
                    running = [torch.zeros(n, device="cuda", dtype=vec_dtype),
                               torch.ones(n, device="cuda", dtype=vec_dtype)]
                    nbt = torch.zeros((), dtype=torch.int64, device="cuda")
                    out, z, coeff = ext.forward_train_saved("lowp_sm90", x, w, *vecs, *running, nbt, 0.1, 1e-5,
                                                            scale_after_bn)
                    g = torch.randn(m, n, device="cuda", generator=gen).to(out.dtype)
                    grads = []
                    for scale in (vecs[1], vecs[1][:1], vecs[1][:1].expand(n)):  # per feature, (1), (N) view
                        for backward in (ext.bn_backward_train, ext.bn_backward_eval):
                            grads += backward(g, z, coeff, scale, scale_after_bn)
                    torch.cuda.synchronize()
                    assert all(bool(torch.isfinite(t).all()) for t in (out, z, coeff, *grads)), (m, k, n, dtype)
            print(f"{m}x{k}x{n}: ok", flush=True)


if __name__ == "__main__":
    main()
