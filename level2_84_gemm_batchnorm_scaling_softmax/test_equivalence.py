"""Problem 84's own equivalence tests: this folder's `model_new.ModelNew`
against `reference.Model` (Linear -> BatchNorm1d -> * scale -> Softmax(dim=1)).
Names as in model_new.py: M = batch, K = in_features, N = out_features.

The checks problem 84 shares with problem 33 (seeded init, state_dict, train /
eval equivalence over several steps, non-contiguous and bad inputs, batch of 1,
empty batch; on a GPU equivalence, accuracy against float64, poisoned outputs,
the current stream, bad inputs, momentum / eps / scale variants) are in the
repository root's test_equivalence.py, parametrized by problem (ids "84-...").
Descriptors, helpers and tolerances: tests/problems.py (problem 84's softmax
criterion there: elementwise |ours - ref| <= 1e-4 |ref| + 1e-7 in float32).

Run: python -m pytest -q level2_84_gemm_batchnorm_scaling_softmax -s   (-s shows the measured errors)

CPU tests (always run, also with a CPU-only torch; ModelNew takes the `_cpu_*` functions)
  - test_seeded_init_positional_args_match_reference: Model(K, N, bn_eps,
    bn_momentum, scale_shape) positionally, scale_shape (1, N): same state_dict
    keys, order and bits, same eps / momentum, same number of random draws
  - test_cpu_scale_shapes_match_reference: every supported scale shape ((), (1,),
    (1, 1), (N,), (1, N)) with random values of both signs, float64 and float32,
    train (3 steps) and eval
  - test_cpu_softmax_rows_sum_to_one: float32 CPU rows sum to 1 within 1e-5,
    train and eval, scale 1, 1.7, -0.8
  - test_unsupported_scale_shape_raises_and_leaves_buffers_unchanged: (2, N),
    (3,) with N != 3, (N, 1): RuntimeError naming the shape, no buffer touched

GPU tests (skipped without CUDA; float32 on cuda; [gemm_path]: run with the
default kernel and again with the portable one forced through model_new.SWITCHES)
  - test_gpu_softmax_rows_sum_to_one [gemm_path]: within 1e-5, train and eval,
    at (1024, 8192, 8192), (257, 4100, 130), (33, 37, 515)
  - test_gpu_unsupported_scale_shape_raises_and_leaves_buffers_unchanged: scale
    (2, N) on CUDA, train and eval: RuntimeError, no buffer touched
"""
import pytest
import torch

from tests.problems import (KERNELBENCH_SHAPE, P84, assert_state_equal, check_seeded_init, cuda_gen, gpu_input,
                            gpu_pair, make_pair, requires_cuda, snapshot, train_then_eval_compare)
from tests.problems import gemm_path  # noqa: F401  (pytest fixture: the GPU tests run on both GEMM kernels)

# Row sums of the softmax output: |sum - 1| <= ROW_SUM_TOL (float32).
ROW_SUM_TOL = 1e-5

# scale shapes by name, as functions of N
SCALE_SHAPES = {
    "()": lambda n: (),
    "(1,)": lambda n: (1,),
    "(1, 1)": lambda n: (1, 1),
    "(N,)": lambda n: (n,),
    "(1, N)": lambda n: (1, n),
    "(2, N)": lambda n: (2, n),
    "(3,)": lambda n: (3,),
    "(N, 1)": lambda n: (n, 1),
}


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1234])
def test_seeded_init_positional_args_match_reference(seed):
    """get_init_inputs() passes every argument positionally (K, N, bn_eps,
    bn_momentum, scale_shape); the keyword cases are in the root file's
    test_seeded_init_matches_reference."""
    check_seeded_init(P84, (12, 10, 1e-5, 0.1, (1, 10)), {}, seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("scale_shape", ["()", "(1,)", "(1, 1)", "(N,)", "(1, N)"])
def test_cpu_scale_shapes_match_reference(scale_shape, dtype):
    m, k, n = 40, 23, 19
    shape = SCALE_SHAPES[scale_shape](n)
    ref, new = make_pair(P84, 4, k, n, eps=1e-3, scale_shape=shape, dtype=dtype, scale="random")
    tol_out, tol_buf = P84.cpu_tol[dtype]
    train_then_eval_compare(ref, new, m, k, dtype, steps=3, tol_out=tol_out, tol_buf=tol_buf,
                            where=f"scale_shape={scale_shape}")


@pytest.mark.parametrize("scale", [1.0, 1.7, -0.8])
def test_cpu_softmax_rows_sum_to_one(scale):
    m, k, n = 129, 33, 257
    _, new = make_pair(P84, 1, k, n, scale=scale)
    gen = torch.Generator().manual_seed(3)
    for mode in ("train", "eval"):
        new.train(mode == "train")
        out = new(torch.randn(m, k, generator=gen))
        assert out.dtype == torch.float32 and bool((out >= 0).all())
        dev = (out.double().sum(dim=1) - 1.0).abs().max().item()
        print(f"\n[row sums] CPU {mode} scale={scale}: max |sum - 1| = {dev:.3e}")
        assert dev <= ROW_SUM_TOL, f"{mode}: row sums deviate from 1 by {dev}"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("scale_shape", ["(2, N)", "(3,)", "(N, 1)"])
def test_unsupported_scale_shape_raises_and_leaves_buffers_unchanged(scale_shape, training):
    m, k, n = 8, 12, 10
    shape = SCALE_SHAPES[scale_shape](n)
    args, kwargs = P84.init_args(k, n, scale_shape=shape)
    torch.manual_seed(12)
    new = P84.ModelNew(*args, **kwargs)
    with torch.no_grad():  # non-trivial buffers
        new.bn.running_mean.uniform_(-1, 1)
        new.bn.running_var.uniform_(0.5, 2)
        new.bn.num_batches_tracked.fill_(5)
    new.train(training)
    before = snapshot(new)
    with pytest.raises(RuntimeError, match="scale") as exc:
        new(torch.randn(m, k))
    assert str(tuple(shape)) in str(exc.value), str(exc.value)
    assert_state_equal(snapshot(new), before, f"after rejected scale shape {scale_shape}")


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

ROW_SUM_SHAPES = [KERNELBENCH_SHAPE, (257, 4100, 130), (33, 37, 515)]


@requires_cuda
@pytest.mark.parametrize("m,k,n", ROW_SUM_SHAPES)
def test_gpu_softmax_rows_sum_to_one(m, k, n, gemm_path):
    _, new = gpu_pair(P84, m, k, n)
    gen = cuda_gen(45)
    for mode in ("train", "eval"):
        new.train(mode == "train")
        with torch.no_grad():
            out = new(gpu_input("uniform", m, k, gen))
        assert bool((out >= 0).all())
        dev = (out.double().sum(dim=1) - 1.0).abs().max().item()
        print(f"\n[row sums] {gemm_path:8s} ({m},{k},{n}) {mode}: max |sum - 1| = {dev:.3e}")
        assert dev <= ROW_SUM_TOL, f"{mode}: row sums deviate from 1 by {dev}"


@requires_cuda
def test_gpu_unsupported_scale_shape_raises_and_leaves_buffers_unchanged():
    m, k, n = 64, 96, 80
    _, new = gpu_pair(P84, m, k, n)
    with torch.no_grad():
        new(torch.rand(m, k, device="cuda"))  # non-trivial buffers
    args, kwargs = P84.init_args(k, n, scale_shape=(2, n))
    torch.manual_seed(33)
    bad_scale = P84.ModelNew(*args, **kwargs).cuda()
    bad_scale.load_state_dict({key: v for key, v in new.state_dict().items() if key != "scale"}, strict=False)
    for training in (True, False):
        bad_scale.train(training)
        before = snapshot(bad_scale)
        with pytest.raises(RuntimeError, match="scale"):
            bad_scale(torch.rand(m, k, device="cuda"))
        torch.cuda.synchronize()
        assert_state_equal(snapshot(bad_scale), before, f"after rejected scale shape (training={training})")
