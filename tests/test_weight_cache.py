"""What the GEMMs precompute from gemm.weight, cached (model_new._weight_parts:
the fp16x3 parts, or the 3xTF32 kernels' row sums): made once, reused while the
weight is unchanged, remade after every change PyTorch's version counter or
storage shows.

Run: python -m pytest -q tests/test_weight_cache.py    (GPU tests skip without CUDA)

  CPU   the cache logic with a stand-in split (a clone of the weight, counted):
        reuse; remade after in-place ops, optimizer.step() (SGD, Adam: for-loop,
        foreach, fused), copy_, load_state_dict and `.data` assignment; not after
        writes through `.data` (documented; clear_weight_cache() recovers);
        entry dropped with its weight; off for inference-mode weights and with
        the switch off; the two kinds are kept apart; make="reused" makes the
        parts on the second sight of an unchanged weight.
  GPU   the forwards of every GEMM path (sm90_fp16x3, sm80_3xtf32):
        after each change, the cached call's output is bit-equal to a call that
        makes the cache afresh; a CUDA graph captured over the forward re-splits
        the weight at every replay; the fp16x3 parts take the weight's own size,
        the row sums 2 N floats.
"""
import gc

import pytest
import torch

import model_new
from tests.problems import gemm_path  # noqa: F401  (fixture)
from tests.test_backward import PROBLEMS, make_pair, requires_cuda


class CountingSplit:
    """Stand-in for the extension's fp16x3_weight_parts: a clone, counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self, weight):
        self.calls += 1
        return weight.detach().clone()


@pytest.fixture
def fresh_cache():
    model_new.clear_weight_cache()
    yield
    model_new.clear_weight_cache()


def linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 32)


def step(lin, opt):
    lin.zero_grad()
    lin(torch.rand(8, 64)).square().mean().backward()
    opt.step()


def cpu_fused_adam():
    try:
        p = torch.nn.Parameter(torch.rand(4))
        p.grad = torch.rand(4)
        torch.optim.Adam([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def test_reused_until_changed(fresh_cache):
    lin, split = linear(), CountingSplit()
    first = model_new._weight_parts(lin.weight, split)
    assert model_new._weight_parts(lin.weight, split) is first and split.calls == 1
    assert torch.equal(first, lin.weight)


def test_made_when_reused(fresh_cache):
    """make="reused" (autocast's training calls): the first sight of a weight
    makes nothing, the second sight of it unchanged makes the parts, a change
    in between starts over; make=False never makes them (negative control)."""
    lin, split = linear(), CountingSplit()
    assert model_new._weight_parts(lin.weight, split, make=False) is None
    assert model_new._weight_parts(lin.weight, split, make="reused") is None and split.calls == 0
    CHANGES["mul_ under no_grad"](lin)
    assert model_new._weight_parts(lin.weight, split, make="reused") is None and split.calls == 0
    assert model_new._weight_parts(lin.weight, split, make=False) is None and split.calls == 0
    parts = model_new._weight_parts(lin.weight, split, make="reused")
    assert split.calls == 1 and torch.equal(parts, lin.weight)
    assert model_new._weight_parts(lin.weight, split, make="reused") is parts and split.calls == 1
    step(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    assert model_new._weight_parts(lin.weight, split, make="reused") is None and split.calls == 1


CHANGES = {
    "mul_ under no_grad": lambda lin: torch.no_grad()(lambda: lin.weight.mul_(1.5))(),
    "SGD for-loop": lambda lin: step(lin, torch.optim.SGD(lin.parameters(), lr=0.1, foreach=False)),
    "SGD foreach": lambda lin: step(lin, torch.optim.SGD(lin.parameters(), lr=0.1, foreach=True)),
    "Adam for-loop": lambda lin: step(lin, torch.optim.Adam(lin.parameters(), lr=0.1, foreach=False)),
    "Adam foreach": lambda lin: step(lin, torch.optim.Adam(lin.parameters(), lr=0.1, foreach=True)),
    "Adam fused": lambda lin: step(lin, torch.optim.Adam(lin.parameters(), lr=0.1, fused=True)),
    "copy_": lambda lin: torch.no_grad()(lambda: lin.weight.copy_(torch.rand(32, 64)))(),
    "load_state_dict": lambda lin: lin.load_state_dict(linear(seed=1).state_dict()),
    ".data assignment": lambda lin: setattr(lin.weight, "data", torch.rand(32, 64)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_change_is_seen(fresh_cache, change):
    if change == "Adam fused" and not cpu_fused_adam():
        pytest.skip("this torch has no fused Adam on the CPU")
    lin, split = linear(), CountingSplit()
    before = model_new._weight_parts(lin.weight, split).clone()
    CHANGES[change](lin)
    assert not torch.equal(lin.weight, before), "the change must change the weight"
    parts = model_new._weight_parts(lin.weight, split)
    assert split.calls == 2 and torch.equal(parts, lin.weight)


def test_writes_through_data_are_not_seen(fresh_cache):
    """Documented limit: `.data` has a version counter of its own."""
    lin, split = linear(), CountingSplit()
    model_new._weight_parts(lin.weight, split)
    lin.weight.data.mul_(2)
    assert not torch.equal(model_new._weight_parts(lin.weight, split), lin.weight)
    model_new.clear_weight_cache()
    assert torch.equal(model_new._weight_parts(lin.weight, split), lin.weight) and split.calls == 2


def test_entry_dies_with_its_weight(fresh_cache):
    lin = linear()
    model_new._weight_parts(lin.weight, CountingSplit())
    assert len(model_new._WEIGHT_PARTS) == 1
    del lin
    gc.collect()
    assert len(model_new._WEIGHT_PARTS) == 0


def test_off_for_inference_weights_and_by_switch(fresh_cache, monkeypatch):
    with torch.inference_mode():
        w = torch.rand(32, 64)
    assert model_new._weight_parts(w, CountingSplit()) is None
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(weight_cache=False))
    assert model_new._weight_parts(linear().weight, CountingSplit()) is None
    assert len(model_new._WEIGHT_PARTS) == 0


def test_kinds_are_kept_apart(fresh_cache):
    """A weight's fp16x3 parts are never served for its row sums, or back."""
    lin, split = linear(), CountingSplit()
    parts = model_new._weight_parts(lin.weight, split, kind="fp16x3")
    sums = model_new._weight_parts(lin.weight, lambda w: w.sum(1), kind="row_sums")
    assert sums.shape == (32,) and torch.equal(sums, lin.weight.sum(1))
    assert model_new._weight_parts(lin.weight, split, kind="fp16x3") is not parts and split.calls == 2


def test_weight_args_only_for_the_extension():
    assert model_new._weight_args(model_new._TORCH_PATH, "torch_ops", linear().weight) == ()


# ---------------------------------------------------------------------------
# GPU: the forwards of each GEMM path
# ---------------------------------------------------------------------------

# The kernel_path prefix of each tests.problems.GEMM_PATHS entry on an H100 / H200.
PATH_PREFIX = {"default": "sm90_fp16x3", "portable": "sm80_3xtf32"}


def cached_pair(problem, path="default", m=192, k=256, n=160):
    ref, new = make_pair(problem, k, n, dtype=torch.float32, device="cuda", seed=4)
    x = torch.rand(m, k, device="cuda")
    if not new.kernel_path(x).startswith(PATH_PREFIX[path]):
        pytest.skip(f"the {PATH_PREFIX[path]} path does not run here ({new.kernel_path(x)})")
    return new, x


def call(model, x, state):
    """model(x) without gradients from `state`, which is restored afterwards."""
    with torch.no_grad():
        out = model(x)
    model.load_state_dict(state)
    return out


@requires_cuda
@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_cached_calls_equal_fresh_splits(fresh_cache, problem, mode, gemm_path):
    new, x = cached_pair(problem, gemm_path)
    changes = {
        "mul_": lambda: torch.no_grad()(lambda: new.gemm.weight.mul_(1.25))(),
        "SGD": lambda: torch.optim.SGD(new.parameters(), lr=0.5).step(),
        "Adam fused": lambda: torch.optim.Adam(new.parameters(), lr=0.01, fused=True).step(),
        "load_state_dict": lambda: new.load_state_dict({k_: v * 1.01 if v.is_floating_point() else v
                                                        for k_, v in new.state_dict().items()}),
        ".data assignment": lambda: setattr(new.gemm.weight, "data", new.gemm.weight.detach() * 0.9),
    }
    for name, change in changes.items():
        new.zero_grad()
        new.train()
        new(x).square().mean().backward()  # gradients for the optimizers
        new.train(mode == "train")
        state = {k_: v.clone() for k_, v in new.state_dict().items()}
        before = call(new, x, state)  # caches the weight's parts
        change()
        state = {k_: v.clone() for k_, v in new.state_dict().items()}
        cached = call(new, x, state)
        model_new.clear_weight_cache()
        fresh = call(new, x, state)
        assert not torch.equal(before, fresh), f"{name} must change the output"
        assert torch.equal(cached, fresh), f"{problem} {mode}: stale weight parts after {name}"


@requires_cuda
def test_gpu_cuda_graph_resplits_at_replay(fresh_cache, gemm_path):
    new, x = cached_pair("33", gemm_path)
    new.eval()
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        new(static_x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = new(static_x)
    with torch.no_grad():
        new.gemm.weight.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    model_new.clear_weight_cache()
    with torch.no_grad():
        assert torch.equal(static_out, new(static_x))


@requires_cuda
def test_gpu_parts_take_the_weights_size(fresh_cache, gemm_path):
    new, x = cached_pair("33", gemm_path, k=1024, n=512)
    with torch.no_grad():
        new(x)
    (entry,) = model_new._WEIGHT_PARTS.values()
    n, k = new.gemm.weight.shape
    size = n * k + -(-n // 4) * 4 + 2 * n if gemm_path == "default" else 2 * n
    assert entry.parts.numel() == size and entry.parts.dtype == torch.float32
    assert entry.ref() is new.gemm.weight


def test_optimizer_writing_through_data_is_seen(fresh_cache):
    """An optimizer that writes `p.data` (no version bump) is caught by the step hook."""

    class DataSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad, alpha=-0.5)

    lin, split = linear(), CountingSplit()
    model_new._weight_parts(lin.weight, split)
    step(lin, DataSGD(lin.parameters()))
    assert torch.equal(model_new._weight_parts(lin.weight, split), lin.weight) and split.calls == 2
