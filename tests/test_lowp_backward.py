"""The 16-bit backward after the GEMM (kernels/lowp/bn_16bit_backward.cu:
bn_backward_train and bn_backward_eval of the 16-bit extension; problem 84's
softmax_rows_backward, kernels/softmax_backward.cuh) against a float64 reference
of what it differentiates, and the Python glue of the operators' backward
(model_new_lowp.backward) on the CPU.
Names: M = batch, N = out_features, K = in_features.

Run: python -m pytest -q tests/test_lowp_backward.py      (GPU tests skip without CUDA)

Reference (bn_backward_reference): float64 autograd of what the kernel's header
says it differentiates, from the same z (M, N), coeff (4, N) rows {mean, invstd,
gamma, beta} and scale (N):
  problem 33: u = rnd_S(z s),  y = gamma (u - mean) invstd + beta,  L = sum g y
  problem 84: u = z,  y = rnd_T(gamma (u - mean) invstd + beta),  L = sum g (y s)
with each rounding's derivative 1 (the rounded value enters as value + a
detached correction, so the reference sees the kernel's rounded values).
Training takes mean and invstd from u's batch (autograd follows them; coeff
holds the same values, as the forward's fold writes them); eval takes them from
coeff as constants (the running statistics).  Returns (dz, dscale, dgamma, dbeta).

CPU (CI)
  - test_cpu_lowp_backward_glue [mode]: model_new_lowp.backward (the operators'
    backward) calls the backward_16bit operator once with the saved tensors and the
    six needs flags, and puts the wanted gradients it returns at their positions
    (None elsewhere), each in its input's dtype; the operator's fake gives the
    shapes and dtypes of the binding's gradients (x16's, w16's, the scale's).

GPU
  - test_gpu_lowp_bn_backward_contract [dtype, problem, mode, g dtype, storage]:
    the extension's bn_backward_train / bn_backward_eval against the reference at
    (257, 264) (a feature tail in the last CTA): dz within 2 units of roundoff of
    the 16-bit dtype (relative Frobenius: it is rounded once), the parameter
    gradients (eval: also the Linear bias's, sum_m dz) in the scale's dtype within
    1e-4 plus that dtype's unit roundoff (float64 sums rounded once; the 1e-4 is
    the reference's own rounding emulation and the float32 coefficients; problem
    33's training dscale, 0 in exact arithmetic up to eps, against the size of its
    terms).  The call's outputs lie in poisoned memory (proved per call: below),
    and no element of any output may still hold the poison.
  - test_gpu_lowp_bn_backward_one_scale [dtype, problem, mode, storage, form]: a
    scale of one number, shape (1) or an (N) stride-0 view: its gradient is the
    reference's float64 sum rounded once (kernels/scale_terms.cuh), the view's
    other elements exactly 0, every other output bit-identical to the per-feature
    call's.
  - test_gpu_lowp_bn_backward_empty_batch [mode, form]: a batch of no rows gives zero
    gradients of the right dtypes and shapes for every form of the scale.
  - test_gpu_lowp_softmax_rows_backward [dtype, shape]: problem 84's row softmax
    backward (softmax_rows_backward, kernels/softmax_backward.cuh) in float16, bfloat16
    and float32 (autocast), each of its three forms: every element written, each within
    its bound of the float64 value from the same inputs, no less accurate than torch's
    kernel, NaN confined to its row; float32 bit for bit the float32 extension's.

Every element written (call_on_poisoned_memory, assert_every_element_written)
  The binding allocates its outputs itself (torch::empty, no out= argument), so
  the test cannot hand it poisoned tensors; it poisons the allocator's free
  memory instead and then PROVES, from addresses, that the outputs landed there:
    1. a probe call gives the outputs' sizes (and runs any first-call set-up);
    2. the test allocates blocks of those sizes (rounded up to the allocator's
       512-byte granularity), fills every byte with 0xFF and frees them,
       remembering their address ranges;
    3. the call runs; the allocator's cumulative allocation count (from the
       poisoning to after the call) must equal the number of non-empty outputs:
       nothing else was allocated, so no temporary can have overwritten poisoned
       memory before an output got its block (otherwise: fail, unprovable);
    4. each output's bytes [data_ptr, data_ptr + nbytes) must lie inside the
       union of the poisoned ranges.  If one does not, the outputs are kept
       alive (their blocks leave the free lists) and 2-4 repeat with more
       poison; after 4 attempts the test FAILS (never a silent pass or skip).
  Then an element the kernel did not write still has every byte 0xFF, a NaN in
  float16, bfloat16 and float32 alike: assert_every_element_written counts
  exactly those bit patterns (plus the finiteness check).  Nothing here assumes
  which block the allocator picks; PyTorch's best-fit allocator, given the same
  sizes in the same order after the poison is freed, picks the poisoned blocks
  on the first attempt.

CPU (CI), negative controls of that checker on FakeCachingMemory (a best-fit,
splitting and coalescing byte arena, freed when a tensor dies) with a fake
kernel of the binding's outputs:
  - test_cpu_poison_checker_passes_a_complete_kernel
  - test_cpu_poison_checker_catches_a_skipped_element [output, element]: the
    skipped element holds a previous call's correct value without the poison
    (invisible to a finiteness or reference check), and is caught with it
  - test_cpu_poison_checker_retries_until_covered: outputs allocated in another
    order miss the poison on the first attempt and are covered on the second
  - test_cpu_poison_checker_refuses_unpoisoned_memory: an allocator that never
    reuses freed memory fails the test instead of passing it vacuously
  - test_cpu_poison_checker_refuses_temporaries: a call that allocates more
    than its outputs fails the test (the poison may have been overwritten)
"""
import math
import types
import weakref

import pytest
import torch

import model_new
from tests.test_backward import rel_err

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ModelNew's kernels)")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
EPS = 1e-5


def rounded(v, dtype):
    """v with the value of its rounding to dtype and the derivative of v (None: v)."""
    if dtype is None or dtype == v.dtype:
        return v
    return v + (v.detach().to(dtype).double() - v.detach())


def bn_backward_reference(g, z, coeff, scale, scale_after_bn, training, t_dtype=None, s_dtype=None):
    """(dz, dscale, dgamma, dbeta) in float64 (module docstring).  t_dtype: the
    16-bit type T of the kernel (84's y is rounded to it); s_dtype: the storage S
    (33's u is rounded to it; float32: autocast's form, no 16-bit rounding there)."""
    z = z.detach().double().requires_grad_(True)
    s = scale.detach().double().requires_grad_(True)
    mean, invstd, gamma, beta = (row.clone() for row in coeff.detach().double())
    gamma.requires_grad_(True)
    beta.requires_grad_(True)
    u = z if scale_after_bn else rounded(z * s, s_dtype)
    if training:
        mean = u.mean(dim=0)
        invstd = torch.rsqrt(u.var(dim=0, unbiased=False) + EPS)
    y = gamma * (u - mean) * invstd + beta
    loss = (g.double() * (rounded(y, t_dtype) * s)).sum() if scale_after_bn else (g.double() * y).sum()
    return torch.autograd.grad(loss, (z, s, gamma, beta))


def training_coeff(u, gamma, beta):
    """coeff (4, N) float64 of u's batch: {mean, rsqrt(biased var + EPS), gamma, beta}."""
    u = u.double()
    return torch.stack((u.mean(dim=0), torch.rsqrt(u.var(dim=0, unbiased=False) + EPS), gamma.double(),
                        beta.double()))


def problem_inputs(m, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(m, k, generator=gen, dtype=torch.float64)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k ** 0.5
    vecs = {"bias": 0.3 * torch.randn(n, generator=gen, dtype=torch.float64),
            "scale": torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,
            "gamma": torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,
            "beta": torch.randn(n, generator=gen, dtype=torch.float64),
            "running_mean": 0.2 * torch.randn(n, generator=gen, dtype=torch.float64),
            "running_var": torch.rand(n, generator=gen, dtype=torch.float64) + 0.3}
    g = torch.randn(m, n, generator=gen, dtype=torch.float64)
    return x, w, vecs, g


def whole_forward(x, w, v, scale_after_bn, training):
    """The float64 forward of either problem (what Model computes), differentiable."""
    z = x @ w.t() + v["bias"]
    u = z if scale_after_bn else z * v["scale"]
    if training:
        mean, var = u.mean(dim=0), u.var(dim=0, unbiased=False)
    else:
        mean, var = v["running_mean"], v["running_var"]
    y = v["gamma"] * (u - mean) * torch.rsqrt(var + EPS) + v["beta"]
    return torch.softmax(y * v["scale"], dim=1) if scale_after_bn else y


# ---- every output element written: poisoned memory, proved by addresses (module docstring)

POISON_BYTE = 0xFF          # every byte: a NaN in float16, bfloat16 and float32 alike
ALLOC_GRANULE_BYTES = 512   # the caching allocator's block granularity (kMinBlockSize)
POISON_ATTEMPTS = 4


class CudaMemory:
    """PyTorch's CUDA caching allocator on `device`, where the binding's outputs come from."""

    def __init__(self, device):
        self.device = torch.device(device)

    def empty(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def allocations(self):
        """Cumulative count of the allocator's allocations on the device."""
        stats = torch.cuda.memory_stats(self.device)
        if "allocation.all.allocated" not in stats:
            pytest.fail("torch.cuda.memory_stats has no allocation count (not the native caching allocator?): "
                        "the outputs' coverage by the poison cannot be proved")
        return stats["allocation.all.allocated"]


def output_span(t):
    """(first byte address, number of bytes) of a contiguous tensor's elements."""
    assert t.is_contiguous(), "outputs must be contiguous"
    return t.data_ptr(), t.numel() * t.element_size()


def inside(span, ranges):
    """Whether the bytes [start, start + n) lie inside the union of ranges (start, n)."""
    start, n = span
    if n == 0:
        return True
    merged = []
    for lo, size in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], lo + size)
        else:
            merged.append([lo, lo + size])
    return any(lo <= start and start + n <= hi for lo, hi in merged)


def call_on_poisoned_memory(call, memory, attempts=POISON_ATTEMPTS):
    """call()'s outputs, computed into memory proved to hold POISON_BYTE before the call.

    The allocator's free memory is poisoned with blocks of the outputs' sizes (from a
    probe call), in the outputs' order; the call may allocate nothing but its outputs
    (so nothing overwrites the poison first), and every output must lie inside the
    poisoned ranges.  A miss keeps that attempt's outputs alive and retries with more
    poison; running out of attempts fails the test."""
    probe = call()
    sizes = [output_span(t)[1] for t in probe]
    del probe
    expected_allocations = sum(1 for n in sizes if n > 0)
    held, misses = [], []
    for attempt in range(attempts):
        blocks = [-(-n // ALLOC_GRANULE_BYTES) * ALLOC_GRANULE_BYTES for n in sizes if n > 0]
        poison = [memory.empty(n).fill_(POISON_BYTE) for n in blocks * 2 ** attempt]
        ranges = [output_span(p) for p in poison]
        before = memory.allocations()
        del poison  # back to the allocator's free lists, still holding the poison
        got = call()
        made = memory.allocations() - before
        if made != expected_allocations:
            pytest.fail(f"the call allocated {made} blocks for {expected_allocations} non-empty outputs: a "
                        "temporary may have overwritten the poison before an output got its block, so an "
                        "unwritten element could go unseen")
        missed = [i for i, t in enumerate(got) if not inside(output_span(t), ranges)]
        if not missed:
            return got
        misses.append(missed)
        held.append(got)  # their blocks stay taken: the next attempt's allocator state differs
    pytest.fail(f"outputs {misses} (per attempt) did not lie in poisoned memory after {attempts} attempts: "
                "the check could not be made")


def unwritten_mask(t):
    """Elements of t whose every byte is still POISON_BYTE."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).view(flat.numel(), t.element_size()).eq(POISON_BYTE).all(dim=1)


def assert_every_element_written(outputs, names):
    """No output element holds the poison (call_on_poisoned_memory's outputs)."""
    for name, t in zip(names, outputs):
        mask = unwritten_mask(t)
        count = int(mask.sum())
        if count:
            flat_index, first = int(mask.nonzero()[0, 0]), []
            for size in reversed(t.shape):
                first.insert(0, flat_index % size)
                flat_index //= size
            pytest.fail(f"{name}: {count} of {t.numel()} elements not written (poison left), first at {first}")


class FakeCachingMemory:
    """A caching allocator in miniature over one CPU byte buffer, for the checker's CPU
    controls: ALLOC_GRANULE_BYTES granularity, best fit (smallest free block, then lowest
    offset) split at its start, a block freed (and coalesced with its free neighbours)
    when its tensor dies.  reuse=False: freed memory is never handed out again."""

    def __init__(self, capacity=1 << 18, reuse=True):
        self.buffer = torch.zeros(capacity, dtype=torch.uint8)
        self.free = {0: capacity}  # offset -> bytes
        self.count = 0
        self.reuse = reuse

    def allocations(self):
        return self.count

    def empty(self, nbytes):
        return self.tensor((nbytes,), torch.uint8)

    def tensor(self, shape, dtype):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        size = max(1, -(-nbytes // ALLOC_GRANULE_BYTES)) * ALLOC_GRANULE_BYTES
        fits = [(n, off) for off, n in self.free.items() if n >= size]
        if not fits:
            raise MemoryError("FakeCachingMemory: out of memory")
        n, off = min(fits)
        del self.free[off]
        if n > size:
            self.free[off + size] = n - size
        self.count += 1
        t = self.buffer[off:off + nbytes].view(dtype).view(shape)
        weakref.finalize(t, self._release, off, size)
        return t

    def _release(self, off, size):
        if not self.reuse:
            return
        after = self.free.pop(off + size, 0)
        before = next((o for o, n in self.free.items() if o + n == off), None)
        if before is None:
            self.free[off] = size + after
        else:
            self.free[before] += size + after


FAKE_M, FAKE_N = 10, 100  # dz: 2000 bytes (4 granules), each vector 400 bytes (1 granule)


def fake_bn_backward(memory, skip=None, order=(0, 1, 2, 3)):
    """A stand-in for bn_backward_train's binding: allocates (dz (M, N) float16, three (N)
    float32) from memory in `order`, writes values that depend only on the position, and
    leaves out element skip = (output, flat index) if given."""
    specs = [((FAKE_M, FAKE_N), torch.float16)] + [((FAKE_N,), torch.float32)] * 3
    outputs = [None] * 4
    for i in order:
        outputs[i] = memory.tensor(*specs[i])
    for i, t in enumerate(outputs):
        flat = t.view(-1)
        kept = None
        if skip is not None and skip[0] == i:  # the element keeps whatever bytes the memory held
            kept = flat[skip[1]:skip[1] + 1].view(torch.uint8).clone()
        flat.copy_(torch.arange(flat.numel(), dtype=torch.float32).mul_(0.25).add_(i))
        if kept is not None:
            flat[skip[1]:skip[1] + 1].view(torch.uint8).copy_(kept)
    return tuple(outputs)


FAKE_NAMES = ["dz", "dscale", "dgamma", "dbeta"]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cpu_lowp_backward_glue(mode, monkeypatch):
    lowp = model_new._LOWP
    calls = []

    def backward_16bit(*args):  # stands in for the operator: the wanted gradients, marked 0, 1, ... in order
        calls.append(args)
        return [torch.full((2,), float(j), dtype=torch.float16) for j in range(sum(args[-1]))]

    monkeypatch.setattr(lowp, "engine", lowp.engine._replace(ops=types.SimpleNamespace(backward_16bit=backward_16bit)))
    m, k, n = 5, 3, 2
    x16, w16, z, out = (torch.rand(m, k, dtype=torch.float16), torch.rand(n, k, dtype=torch.float16),
                        torch.rand(m, n, dtype=torch.float16), torch.rand(m, n, dtype=torch.float16))
    scale, coeff, g = torch.rand(1, dtype=torch.float16), torch.rand(4, n), torch.rand(m, n, dtype=torch.float16)
    needs = (True, False, True, True, False, True)
    dtypes = (torch.float16, torch.float16, torch.float32, torch.float16, torch.float16, torch.bfloat16)
    got = lowp.backward(mode == "train", True, g, x16, w16, scale, z, coeff, out, needs, dtypes)
    assert len(calls) == 1
    call = calls[0]
    assert call[:2] == (mode == "train", True) and call[9] == list(needs)
    assert all(a is b for a, b in zip(call[2:9], (g, x16, w16, scale, z, coeff, out)))
    assert [t is None for t in got] == [not need for need in needs]
    wanted = [t for t in got if t is not None]
    assert [t.dtype for t in wanted] == [d for d, need in zip(dtypes, needs) if need]
    assert [t[0].item() for t in wanted] == [0.0, 1.0, 2.0, 3.0]  # the operator's order, placed by needs
    fake = lowp._fake_backward_16bit(mode == "train", True, g, x16, w16, scale, z, coeff, out, [True] * 6)
    assert [(tuple(t.shape), t.dtype) for t in fake] == [((m, k), torch.float16), ((n, k), torch.float16)] + [
        ((n,), torch.float16), ((1,), torch.float16), ((n,), torch.float16), ((n,), torch.float16)]


def test_cpu_poison_checker_passes_a_complete_kernel():
    memory = FakeCachingMemory()
    got = call_on_poisoned_memory(lambda: fake_bn_backward(memory), memory)
    assert_every_element_written(got, FAKE_NAMES)
    for i, t in enumerate(got):
        assert torch.equal(t.view(-1).float(), torch.arange(t.numel(), dtype=torch.float32) * 0.25 + i)


@pytest.mark.parametrize("element", ["first", "middle", "last"])
@pytest.mark.parametrize("output", range(4), ids=FAKE_NAMES)
def test_cpu_poison_checker_catches_a_skipped_element(output, element):
    numel = FAKE_M * FAKE_N if output == 0 else FAKE_N
    index = {"first": 0, "middle": numel // 2 + 1, "last": numel - 1}[element]
    memory = FakeCachingMemory()
    # Without the poison the skipped element holds the previous call's value: the same as
    # a complete kernel's, finite and exact.
    complete = [t.clone() for t in fake_bn_backward(memory)]
    stale = fake_bn_backward(memory, skip=(output, index))
    assert all(torch.equal(a, b) for a, b in zip(stale, complete)), "the skip should be invisible here"
    del stale
    got = call_on_poisoned_memory(lambda: fake_bn_backward(memory, skip=(output, index)), memory)
    with pytest.raises(pytest.fail.Exception, match=rf"{FAKE_NAMES[output]}: 1 of {numel} elements not written"):
        assert_every_element_written(got, FAKE_NAMES)
    assert not bool(torch.isfinite(got[output]).all())


def test_cpu_poison_checker_retries_until_covered():
    memory = FakeCachingMemory()
    # A free 4-granule hole before the rest: the poison's dz takes it, the vectors the
    # start of the rest; outputs allocated vectors first fill the hole with them and
    # put dz where only 3 granules were poisoned.
    hole, pin = memory.tensor((4 * ALLOC_GRANULE_BYTES,), torch.uint8), memory.empty(1)
    del hole
    calls = []

    def call():
        calls.append(1)
        return fake_bn_backward(memory, order=(1, 2, 3, 0))

    got = call_on_poisoned_memory(call, memory)
    assert len(calls) == 3, "probe, a miss, then a covered attempt"
    assert_every_element_written(got, FAKE_NAMES)
    del pin


def test_cpu_poison_checker_refuses_unpoisoned_memory():
    memory = FakeCachingMemory(reuse=False)
    with pytest.raises(pytest.fail.Exception, match="did not lie in poisoned memory"):
        call_on_poisoned_memory(lambda: fake_bn_backward(memory), memory)


def test_cpu_poison_checker_refuses_temporaries():
    memory = FakeCachingMemory()

    def call():
        memory.empty(4096).fill_(0)  # a temporary, written and freed before the outputs
        return fake_bn_backward(memory)

    with pytest.raises(pytest.fail.Exception, match="allocated 5 blocks for 4 non-empty outputs"):
        call_on_poisoned_memory(call, memory)


def backward_case(training, scale_after_bn, t_dtype, s_dtype, g_dtype, seed, scale=None, m=257, n=264):
    """(z, scale, g, coeff) of one bn_backward call at (m, n), drawn from `seed` in this order: z (T),
    scale (N) of s_dtype unless given, gamma, beta, g (g_dtype), eval's running statistics.  coeff (4, N)
    float32: training, the batch's of the kernel's u (33: rnd_S(z s)); eval, the drawn running statistics."""
    gen = torch.Generator().manual_seed(seed)
    z = (0.5 + torch.randn(m, n, generator=gen)).to("cuda", t_dtype)
    if scale is None:
        scale = (torch.rand(n, generator=gen) + 0.5).to("cuda", s_dtype)
    gamma = torch.rand(n, generator=gen) + 0.5
    beta = torch.randn(n, generator=gen)
    g = torch.randn(m, n, generator=gen).to("cuda", g_dtype)
    if training:
        z64, s64 = z.double().cpu(), scale.double().cpu()
        u = z64 if scale_after_bn else (z64 * s64).to(s_dtype).double()  # the kernel's u
        coeff = training_coeff(u, gamma, beta)
    else:
        coeff = torch.stack((0.2 * torch.randn(n, generator=gen).double(),
                             torch.rsqrt(torch.rand(n, generator=gen).double() + 0.3 + EPS),
                             gamma.double(), beta.double()))
    return z, scale, g, coeff.to("cuda", torch.float32).contiguous()


@requires_cuda
@pytest.mark.parametrize("storage", ["16bit", "float32"])
@pytest.mark.parametrize("g_dtype", ["16bit", "float32"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("n", [264, 256], ids=["registers", "staged"])
def test_gpu_lowp_bn_backward_contract(n, dtype_name, problem, mode, g_dtype, storage):
    """Both forms of bn16_backward: N = 264 loads its rows into registers, N = 256 (N % 32 == 0,
    16-byte aligned g and z) streams them through shared memory (the staged form)."""
    t_dtype = DTYPES[dtype_name]
    s_dtype = t_dtype if storage == "16bit" else torch.float32
    scale_after_bn, training = problem == "84", mode == "train"
    z, scale, g, coeff = backward_case(training, scale_after_bn, t_dtype, s_dtype,
                                       t_dtype if g_dtype == "16bit" else torch.float32, seed=11, n=n)
    ext = model_new._LOWP.kernels()
    fn = ext.bn_backward_train if training else ext.bn_backward_eval
    # The outputs land in poisoned memory (proved by their addresses) and keep no poison.
    got = call_on_poisoned_memory(lambda: fn(g, z, coeff, scale, scale_after_bn), CudaMemory(z.device))
    names = ["dz", "dscale", "dgamma", "dbeta"] if training else ["dz", "dbias", "dscale", "dgamma", "dbeta"]
    assert_every_element_written(got, names)
    want = bn_backward_reference(g, z, coeff, scale, scale_after_bn, training, t_dtype, s_dtype)
    if not training:  # the Linear bias's gradient, sum_m dz
        want = (want[0], want[0].sum(dim=0)) + tuple(want[1:])
    for name, a, b in zip(names, got, want):
        assert bool(torch.isfinite(a).all()), f"{name}: non-finite (unwritten) elements"
        err = rel_err(a, b)
        if name == "dscale" and training and not scale_after_bn:
            # sum_m du z is 0 in exact arithmetic up to eps (BatchNorm undoes the scale): measured
            # against the size of its terms, sum_m |du z|, instead of itself
            terms = (want[0].abs() * z.double().abs()).sum(dim=0) / scale.double().abs()
            err = ((a.double() - b).norm() / terms.norm()).item()
        # dz and a 16-bit parameter gradient are rounded once to their type
        bound = 2 * UNIT_ROUNDOFF[t_dtype] if name == "dz" else 1e-4 + UNIT_ROUNDOFF.get(s_dtype, 0.0)
        print(f"[{dtype_name} {problem} {mode} g {g_dtype} S {storage}] {name}: err {err:.2e} (bound {bound:.1e})")
        assert err <= bound, name
    assert got[0].dtype == t_dtype and all(t.dtype == s_dtype for t in got[1:])
    assert all(t.shape == (n,) for t in got[1:])


@requires_cuda
@pytest.mark.parametrize("form", ["shape1", "view"])
@pytest.mark.parametrize("storage", ["16bit", "float32"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_bn_backward_one_scale(dtype_name, problem, mode, storage, form):
    """A scale of one number (problem 84's default), of shape (1) or viewed as (N) with stride 0:
    its gradient is the float64 sum of the N per-feature terms, rounded once to the scale's type
    (kernels/scale_terms.cuh): within a unit of roundoff (through float32: + 2^-24) of the float64
    reference's sum, plus 1e-6 of the terms' absolute sum (the float32 coefficients: up to 2e-7
    measured on the H200; problem 33's training gradient, 0 in exact arithmetic up to eps, against
    its terms' size as in the contract test).  Printed beside it: the error of the old sum, the
    terms rounded to the scale's type, summed in float32 and rounded (autograd's expand backward).
    Shape (1): a (1) gradient; the view: [the gradient, 0, ..., 0] with exact zeros.  Every other
    output bit-identical to the call with the scale copied to N elements."""
    t_dtype = DTYPES[dtype_name]
    s_dtype = t_dtype if storage == "16bit" else torch.float32
    scale_after_bn, training = problem == "84", mode == "train"
    n = 264
    one = torch.tensor([0.75], dtype=s_dtype, device="cuda")
    z, _, g, coeff = backward_case(training, scale_after_bn, t_dtype, s_dtype, t_dtype, seed=12,
                                   scale=one.expand(n).contiguous(), n=n)
    scale = one if form == "shape1" else one.expand(n)
    ext = model_new._LOWP.kernels()
    fn = ext.bn_backward_train if training else ext.bn_backward_eval
    got = fn(g, z, coeff, scale, scale_after_bn)
    per_feature = fn(g, z, coeff, one.expand(n).contiguous(), scale_after_bn)
    at = 1 if training else 2  # dscale's place
    for i, (a, b) in enumerate(zip(got, per_feature)):
        if i != at:
            assert a.dtype == b.dtype and torch.equal(a, b), f"output {i}"
    dscale = got[at]
    assert dscale.dtype == s_dtype and dscale.shape == ((1,) if form == "shape1" else (n,))
    if form == "view":
        assert torch.count_nonzero(dscale[1:]) == 0
    dz, terms = bn_backward_reference(g, z, coeff, one.expand(n).contiguous(), scale_after_bn, training, t_dtype,
                                      s_dtype)[:2]
    want = terms.sum().item()
    if training and not scale_after_bn:
        size = (dz.abs() * z.double().abs()).sum().item() / 0.75  # sum |du z|, as the contract test's
    else:
        size = terms.abs().sum().item()
    err = abs(dscale[0].double().item() - want)
    bound = (UNIT_ROUNDOFF.get(s_dtype, 2.0 ** -24) + 2.0 ** -24) * abs(want) + 1e-6 * size
    old_sum = abs(terms.to(s_dtype).float().sum().to(s_dtype).double().item() - want)
    print(f"[{dtype_name} {problem} {mode} S {storage} {form}] |error| {err:.2e} (bound {bound:.2e}; the terms "
          f"rounded to S, then summed: {old_sum:.2e})")
    assert math.isfinite(err) and err <= bound


@requires_cuda
@pytest.mark.parametrize("form", ["per_feature", "shape1", "view"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_lowp_bn_backward_empty_batch(mode, form):
    """A batch of no rows (the operators called directly: the module returns before them) gives an
    empty grad_z and zero parameter gradients of the scale's dtype, grad_scale of the scale's shape,
    whatever form the scale takes (no float64 scratch is needed: nothing is summed)."""
    n = 40
    z = torch.empty(0, n, dtype=torch.float16, device="cuda")
    coeff = torch.rand(4, n, device="cuda")
    one = torch.tensor([0.75], dtype=torch.float16, device="cuda")
    scale = {"per_feature": one.expand(n).contiguous(), "shape1": one, "view": one.expand(n)}[form]
    ext = model_new._LOWP.kernels()
    fn = ext.bn_backward_train if mode == "train" else ext.bn_backward_eval
    got = fn(torch.empty_like(z), z, coeff, scale, True)
    assert got[0].shape == (0, n) and len(got) == (4 if mode == "train" else 5)
    for t in got[1:]:
        assert t.dtype == torch.float16 and torch.count_nonzero(t) == 0
    assert got[-3].shape == ((1,) if form == "shape1" else (n,))


# (M, N) of the softmax backward contract: the register form (N = 8192, at most 16384 16-bit
# or 8192 float32 elements a row), the loop over 16-byte groups (N = 20008: past both), and the
# loop over single elements (N = 1001: no 16-byte groups).
SOFTMAX_BACKWARD_SHAPES = [(37, 8192), (9, 20008), (21, 1001)]


@requires_cuda
@pytest.mark.parametrize("shape", SOFTMAX_BACKWARD_SHAPES, ids=["registers", "loop_vec", "loop"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
def test_gpu_lowp_softmax_rows_backward(dtype_name, shape):
    """The 16-bit extension's softmax_rows_backward (kernels/softmax_backward.cuh) on
    softmax rows out and a gradient g of one dtype: every element of grad_v written
    (poisoned memory), within (u + 2^-22) |want| + 2^-40 |out| |s| + the smallest
    normal of the float64 want = out (g - s), s = sum_n g out, from the same inputs
    (u the dtype's unit roundoff: rounded once to float32, then to the dtype; the
    last terms: s held as two floats, and subnormal results); its error no larger
    than torch's _softmax_backward_data's (the 16-bit one rounds g out first) plus
    a unit roundoff of the largest |want|; a NaN in g makes its row NaN and no other;
    float32 bit for bit the float32 extension's kernel (the same one)."""
    dtype = torch.float32 if dtype_name == "float32" else DTYPES[dtype_name]
    m, n = shape
    gen = torch.Generator().manual_seed(31)
    out = torch.softmax(3 * torch.randn(m, n, generator=gen, dtype=torch.float64), dim=1).to("cuda", dtype)
    g = torch.randn(m, n, generator=gen).to("cuda", dtype)
    ext = model_new._LOWP.kernels()
    (got,) = call_on_poisoned_memory(lambda: (ext.softmax_rows_backward(out, g),), CudaMemory(out.device))
    assert_every_element_written((got,), ["grad_v"])
    assert got.dtype == dtype and got.shape == (m, n)
    o64, g64 = out.double(), g.double()
    s = (o64 * g64).sum(dim=1, keepdim=True)
    want = o64 * (g64 - s)
    u = UNIT_ROUNDOFF.get(dtype, 2.0 ** -24)
    bound = (u + 2.0 ** -22) * want.abs() + 2.0 ** -40 * o64.abs() * s.abs() + torch.finfo(dtype).smallest_normal
    excess = ((got.double() - want).abs() - bound).max().item()
    torch_err = (torch._softmax_backward_data(g, out, 1, dtype).double() - want).abs().max().item()
    err = (got.double() - want).abs().max().item()
    print(f"[{dtype_name} {m}x{n}] max |error| {err:.3e}, torch's {torch_err:.3e}")
    assert excess <= 0, f"an element exceeds its bound by {excess:.3e}"
    assert err <= torch_err + u * want.abs().max().item()
    if dtype == torch.float32:
        assert torch.equal(got, model_new._ext.softmax_rows_backward(out, g))
    g[3, n // 2] = float("nan")
    nan_case = ext.softmax_rows_backward(out, g)
    assert bool(torch.isnan(nan_case[3]).all()) and bool(torch.isfinite(nan_case[torch.arange(m) != 3]).all())
