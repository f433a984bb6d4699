"""bench.py's pieces that run without a GPU (CPU, CI): the command line, the
sweep's shapes, the floors' products (shapes, dtypes, K padding) on the meta
device, the --optimizer step, the sweep plot and the sides' orders (balanced_orders).  The timings themselves need a
GPU and are not tested here.
"""
import pytest
import torch

import bench


def _mm_has_out_dtype():
    a = torch.zeros(1, 8, device="meta", dtype=torch.float16)
    try:
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return True


needs_out_dtype = pytest.mark.skipif(not _mm_has_out_dtype(), reason="this torch's mm has no out_dtype")


@pytest.fixture
def mm_calls(monkeypatch):
    """bench's device set to meta, and every torch.mm call recorded as
    (a's shape, b's shape, a's strides, b's strides, a's dtype, out_dtype)."""
    monkeypatch.setattr(bench, "DEVICE", "meta")
    calls, real_mm = [], torch.mm

    def mm(a, b, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape), a.stride(), b.stride(), a.dtype, kwargs.get("out_dtype")))
        return real_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    return calls


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders(n):
    """Every order is a permutation of the sides, and over the orders each side comes
    right after every other side equally often (never after itself)."""
    orders = bench.balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = {}
    for order in orders:
        for before, after in zip(order, order[1:]):
            follows[before, after] = follows.get((before, after), 0) + 1
    assert all(a != b for a, b in follows)
    if n > 1:
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, follows


def test_parse_args_defaults_unchanged():
    args = bench.parse_args([])
    assert args.shape == (1024, 8192, 8192) and args.model == "both" and args.mode == "train"
    assert not args.backward and not args.sweep and args.optimizer is None


def test_parse_args_optimizer():
    args = bench.parse_args(["--backward", "--optimizer", "sgd", "--model", "33"])
    assert args.backward and args.optimizer == "sgd"


@pytest.mark.parametrize("argv", [["--optimizer", "sgd"], ["--backward", "--optimizer", "adam"],
                                  ["--backward", "--sweep"], ["--sweep", "--optimizer", "sgd"],
                                  ["--sweep", "--autocast", "float16"], ["--sweep", "--grad"],
                                  ["--shape", "1,64,64"], ["--shape", "1,64,64", "--mode", "both"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_parse_args_one_row_in_eval():
    """A batch of one row in eval (issue 50's M = 1 cells): build_models settles both models on 2 rows."""
    args = bench.parse_args(["--shape", "1,64,64", "--mode", "eval"])
    assert args.shape == (1, 64, 64) and args.mode == "eval"


def test_sweep_shapes():
    shapes = bench.SWEEP_SHAPES
    assert len(shapes) == len(set(shapes))
    assert all(min(shape) >= 1 for shape in shapes)
    for f in (1024, 2048, 4096, 8192):  # every feature size up to 16384 rows
        assert {(m, f, f) for m in (128, 1024, 8192, 16384)} <= set(shapes)
    assert (16384, 4096, 4096) in shapes  # issue 39's large-batch shape
    assert (1024, 8192, 8192) in shapes  # KernelBench's
    assert any(k % 8 for _, k, _ in shapes)  # the floor's K padding is exercised


@pytest.mark.parametrize("k, padded", [(1, 8), (7, 8), (8, 8), (9, 16), (1028, 1032), (8188, 8192), (8192, 8192)])
def test_padded_k(k, padded):
    assert bench._padded_k(k) == padded


def test_fp16_operand_pads_with_zeros(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    t = bench._fp16_operand(5, 13)
    assert t.shape == (5, 16) and t.dtype == torch.float16
    assert torch.all(t[:, 13:] == 0) and torch.all((t[:, :13] >= 0) & (t[:, :13] <= 1))


@needs_out_dtype
@pytest.mark.parametrize("m, k, n", [(3, 13, 5), (64, 8192, 96)])
def test_gemm_floor_products(mm_calls, m, k, n):
    floor = bench.gemm_floor(m, k, n)
    mm_calls.clear()  # the out_dtype probe
    floor(None)
    k8 = bench._padded_k(k)
    assert len(mm_calls) == 3
    for a_shape, b_shape, a_stride, b_stride, dtype, out_dtype in mm_calls:
        assert (a_shape, b_shape) == ((m, k8), (k8, n))
        assert a_stride == (k8, 1) and b_stride == (1, k8)  # x and W rows K-contiguous, 16-byte aligned
        assert dtype == torch.float16 and out_dtype == torch.float32


@needs_out_dtype
def test_gemm_floor_step_float32(mm_calls):
    m, k, n = 6, 13, 5
    floor = bench.gemm_floor_step(m, k, n)
    mm_calls.clear()
    floor(None)
    k8 = bench._padded_k(k)
    shapes = [(a, b) for a, b, *_ in mm_calls]
    # forward z = x W^T, grad x = g W, grad W = g^T x, three float16 products each
    assert shapes == [((m, k8), (k8, n))] * 3 + [((m, n), (n, k8))] * 3 + [((n, m), (m, k8))] * 3
    assert all(dtype == torch.float16 and out == torch.float32 for *_, dtype, out in mm_calls)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_floor_step_16bit(mm_calls, dtype):
    m, k, n = 6, 13, 5
    bench.gemm_floor_step(m, k, n, dtype)(None)
    shapes = [(a, b) for a, b, *_ in mm_calls]
    assert shapes == [((m, k), (k, n)), ((m, n), (n, k)), ((n, m), (m, k))]
    assert all(d == dtype and out is None for *_, d, out in mm_calls)


def test_make_optimizer_steps_every_parameter():
    assert bench.make_optimizer(None, torch.nn.Linear(4, 3)) is None
    model = torch.nn.Linear(4, 3)
    optimizer = bench.make_optimizer("sgd", model)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == bench.OPTIMIZER_LR
    model(torch.rand(2, 4)).sum().backward()
    versions = [p._version for p in model.parameters()]
    optimizer.step()  # the version counter moves: ModelNew's weight cache sees the change
    assert all(p._version > v for p, v in zip(model.parameters(), versions))


def test_plot_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"mode": mode, "M": m, "K": k, "N": n, "speedup_vs_eager": 3.0, "modelnew_time_over_floor": 1.2}
            for mode in ("train", "eval") for m, k, n in bench.SWEEP_SHAPES]
    env = {"model": "33", "dtype": "float32", "device": "test", "torch": torch.__version__}
    path = bench.plot_sweep(rows, str(tmp_path / "sweep.png"), env)
    assert path is not None and (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_gpu():
    assert bench.main(["--sweep"]) == 2
    assert bench.main(["--backward", "--optimizer", "sgd"]) == 2


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench on the CPU: DEVICE "cpu", time_fn replaced by a stand-in that makes
    the same calls (prepare, then the side) and returns fixed times, and torch.mm
    taking out_dtype (float32 products of the 16-bit operands) where the CPU lacks
    it.  Returns the number of calls per side."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    calls = {}

    def time_fn(fns, inputs, iters, warmup, prepare=None, host=None, synchronized=False):
        for rep in range(warmup + iters):
            x = inputs[rep % len(inputs)]
            for name, fn in fns.items():
                if prepare is not None:
                    prepare[name](x)
                fn(x)
                calls[name] = calls.get(name, 0) + 1
        if host is not None:
            host.update({name: {"host_us": [1.0], "gpu_waited": 0} for name in fns})
        return {name: [2.0 if name == "eager" else 1.0] * iters for name in fns}

    real_mm = torch.mm

    def mm(a, b, out_dtype=None):
        return real_mm(a.float(), b.float()) if out_dtype is not None else real_mm(a, b)

    monkeypatch.setattr(bench, "time_fn", time_fn)
    monkeypatch.setattr(torch, "mm", mm)
    return calls


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_backward_optimizer_flow(cpu_bench, monkeypatch, mode):
    """--backward --optimizer sgd: each timed call of eager and ModelNew steps its own
    optimizer (the weights change, both from one state), the floor is timed beside."""
    args = bench.parse_args(["--backward", "--optimizer", "sgd", "--model", "33", "--shape", "16,13,12",
                             "--iters", "3", "--warmup", "1", "--mode", mode])
    problem = bench.load_problem("33")
    built = {}
    real_build = bench.build_models

    def build_models(*a, **kw):
        ref, new = real_build(*a, **kw)
        built["weights"] = [m.gemm.weight.detach().clone() for m in (ref, new)]
        built["models"] = (ref, new)
        return ref, new

    monkeypatch.setattr(bench, "build_models", build_models)
    rows, check = bench.bench_backward_mode(problem, args, mode)
    assert cpu_bench == {"eager": 8, "ModelNew": 8, "floor": 8}  # both protocols: back to back, synchronized
    assert all(r["sync_median_ms"] == 1.0 or r["side"] == "eager" for r in rows)
    assert {r["side"] for r in rows} == {"eager", "ModelNew", "floor"}
    assert all(r["kind"] == "forward+backward+sgd" for r in rows)
    assert check["optimizer"] == "sgd" and check["modelnew_time_over_floor"] == 1.0
    assert torch.equal(*built["weights"])  # one starting state
    for model, w0 in zip(built["models"], built["weights"]):
        assert not torch.equal(model.gemm.weight.detach(), w0)  # the optimizer stepped


def test_sweep_flow(cpu_bench, monkeypatch):
    monkeypatch.setattr(bench, "SWEEP_SHAPES", [(8, 16, 16), (5, 13, 7)])
    args = bench.parse_args(["--sweep", "--iters", "2", "--warmup", "1", "--model", "33"])
    rows = bench.run_sweep(bench.load_problem("33"), args, ["train"])
    assert [(r["M"], r["K"], r["N"]) for r in rows] == [(8, 16, 16), (5, 13, 7)]
    assert all(r["floor_ms"] == 1.0 and r["modelnew_time_over_floor"] == 1.0 for r in rows)
    # eager and ModelNew in both protocols; the floors back to back only
    assert cpu_bench == {"eager": 12, "ModelNew": 12, "floor": 6, "w_copy": 6}
    assert all(r["w_read_ms"] == 0.5 and r["sync_speedup_vs_eager"] == 2.0 for r in rows)


@pytest.mark.parametrize("porcelain,returncode,expected", [("", 0, "abc1234"), (" M bench.py\n", 0, "abc1234+changes"),
                                                           ("", 128, "abc1234+changes")])
def test_git_revision_marks_changed_trees(monkeypatch, porcelain, returncode, expected):
    """The printed revision names the code that ran: "+changes" where tracked files differ from
    HEAD (or git status cannot tell), so a copy whose .git is older than its files is not taken
    for HEAD's code."""
    import subprocess

    def run(cmd, **kwargs):
        if cmd[:2] == ["git", "rev-parse"]:
            return subprocess.CompletedProcess(cmd, 0, "abc1234\n", "")
        return subprocess.CompletedProcess(cmd, returncode, porcelain, "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    assert bench._git_revision() == expected


def test_git_revision_outside_a_checkout(monkeypatch):
    import subprocess
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 128, "", ""))
    assert bench._git_revision() is None
