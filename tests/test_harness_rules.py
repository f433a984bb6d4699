"""tools/harness_rules.py, the checker of the rules benchmark harnesses apply to a
submitted model file.  CPU-only, needs no torch and no GPU; runs in CI.

  - positive control: a clean synthetic model text (a `__global__` kernel and a
    `load_inline(...)` call) gives no violation
  - negative controls: each rule fires on the clean text plus one short snippet
    that breaks it, named by the rule's message; the KernelBench-derived rules
    (its static checker, backend cuda, precision fp32, errors and warnings) are
    covered pattern by pattern, most as text inside a string literal, since the
    harnesses scan strings and docstrings too
  - `#` and `//` comment tails are ignored, as by the harnesses
  - `@` is allowed only inside the plain-PyTorch functions (`_torch_*`)
The clean text is synthetic on purpose: dist/model_new.py is checked by
tests/test_bundle.py.
"""
import pytest

from tools.harness_rules import violations

CLEAN = '''"""A clean model file: one CUDA kernel built by load_inline."""
import torch
from torch.utils.cpp_extension import load_inline

CUDA_SRC = r"""
__global__ void scale_kernel(const float* x, float* y, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = s * x[i];
}
"""


def _build():
    return load_inline(name="scale_ext", cpp_sources="", cuda_sources=CUDA_SRC, functions=["scale"])


class ModelNew(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return _build().scale(x, self.weight)
'''


def as_string(text):
    """`text` as a string literal on its own line: only the text rules can see it."""
    return f"_S = {text!r}\n"


def flagged(snippet):
    """Violations of the clean text with `snippet` appended."""
    return violations(CLEAN + "\n" + snippet + "\n")


# name -> (snippet appended to CLEAN, a fragment the violation's message must contain)
NEGATIVE = {
    # try / except / pass
    "try statement": ("try:\n    x = 1\nfinally:\n    x = 2\n", "try statement"),
    "word try in a docstring": ('"""We try the fast path."""', "the word `try`"),
    "word except in a string": (as_string("everything except this"), "the word `except`"),
    "word pass": ("def f():\n    pass\n", "the word `pass`"),
    "try: in a string": (as_string("try: x = 1"), "the word `try`"),
    "except X in a string": (as_string("except ValueError"), "the word `except`"),
    # timing monkey-patches (existing rules and the AST)
    "setattr on torch": ("setattr(torch.cuda, 'Event', None)\n", "setattr"),
    "setattr text": (as_string("setattr(time, 'time', f)"), "timing monkey-patch"),
    "time.sleep assigned": ("import time\ntime.sleep = None\n", "timing monkey-patch"),
    "assignment under torch (AST)": ("torch.backends.cudnn.enabled = False\n", "assignment to torch.backends"),
    "elapsed_time assigned": (as_string("ev.elapsed_time = f"), "timing monkey-patch"),
    # timing monkey-patches (KernelBench: `=` and `==`, any prefix before `time.`)
    "torch.cuda.Event.record =": (as_string("torch.cuda.Event.record = f"), "timing monkey-patch"),
    "torch.cuda.Event.elapsed_time =": (as_string("torch.cuda.Event.elapsed_time = f"), "timing monkey-patch"),
    "torch.cuda.synchronize =": (as_string("torch.cuda.synchronize = f"), "timing monkey-patch"),
    "torch.cuda.Event =": (as_string("torch.cuda.Event = f"), "timing monkey-patch"),
    "time.perf_counter =": (as_string("time.perf_counter = f"), "timing monkey-patch"),
    "time.time =": (as_string("time.time = f"), "timing monkey-patch"),
    "time.time ==": (as_string("ok = time.time == t"), "timing monkey-patch"),
    "torch.cuda.synchronize ==": (as_string("ok = torch.cuda.synchronize == f"), "timing monkey-patch"),
    "torch.cuda.Event.record ==": (as_string("ok = torch.cuda.Event.record == r"), "timing monkey-patch"),
    "start_time.time =": (as_string("start_time.time = 1"), "timing monkey-patch"),
    # threads, processes (existing, AST, KernelBench substrings)
    "import threading": ("import threading\n", "threads"),
    "import _thread (AST)": ("import _thread\n", "import of _thread"),
    "import asyncio": ("import asyncio\n", "threads"),
    "Thread(": (as_string("t = Thread(target=f)"), "threads"),
    "_threading.Thread(": (as_string("_threading.Thread(target=f)"), "threads"),
    "import threadingx": (as_string("import threadingx"), "threads"),
    "from threading import": (as_string("from threading import Thread"), "threads"),
    "multiprocessing.Pool": (as_string("p = multiprocessing.Pool(2)"), "threads"),
    "from multiprocessing import": (as_string("from multiprocessing import Queue"), "threads"),  # ours only
    "concurrent.futures": (as_string("import concurrent.futures"), "threads"),
    "ThreadPoolExecutor": (as_string("ex = ThreadPoolExecutor(2)"), "threads"),
    "ProcessPoolExecutor": (as_string("ex = ProcessPoolExecutor(2)"), "threads"),
    # streams (existing and KernelBench)
    "cudaStreamCreate": (as_string("cudaStreamCreate(&s);"), "extra streams"),
    "getStreamFromPool": (as_string("at::cuda::getStreamFromPool()"), "extra streams"),
    "torch.cuda.Stream(": (as_string("s = torch.cuda.Stream()"), "extra streams"),
    "cuda.Stream(": (as_string("s = cuda.Stream()"), "extra streams"),
    "with torch.cuda.stream": (as_string("with torch.cuda.stream(s): y = 1"), "extra streams"),
    "wait_stream": (as_string("torch.cuda.current_stream().wait_stream(s)"), "extra streams"),
    "record_stream": (as_string("x.record_stream(s)"), "extra streams"),
    # lazy / deferred tensors (existing and KernelBench)
    "torch._lazy": (as_string("torch._lazy.mark_step()"), "lazy"),
    "LazyTensor": (as_string("LazyTensor(x)"), "lazy"),
    "__torch_function__": (as_string("__torch_function__ = None"), "lazy"),
    "__torch_dispatch__": (as_string("__torch_dispatch__ = None"), "lazy"),
    "torch.jit.fork": (as_string("fut = torch.jit.fork(f, x)"), "lazy"),
    "_make_subclass": (as_string("y = torch.Tensor._make_subclass(cls, t)"), "lazy"),
    "class X(torch.Tensor)": ("class Lazy(torch.Tensor):\n    x = 1\n", "lazy"),
    "class X(Tensor)": (as_string("class Lazy(Tensor): x = 1"), "lazy"),
    "class ... (torch.Tensor) in prose": (as_string("a class Foo holding (torch.Tensor)"), "lazy"),
    "torch.Tensor.__new__": (as_string("t = torch.Tensor.__new__(cls)"), "lazy"),
    # half precision (existing)
    "float16": (as_string("torch.float16"), "half precision"),
    "bfloat16": (as_string("x.to(torch.bfloat16)"), "half precision"),
    ".half()": ("y = torch.ones(2).half()\n", "half precision"),
    "autocast": (as_string("with torch.autocast('cuda'): y = 1"), "half precision"),
    "__half": (as_string("__half h;"), "half precision"),
    "__nv_bfloat16": (as_string("__nv_bfloat16 h;"), "half precision"),
    "cuda_fp16.h": (as_string("include <cuda_fp16.h>"), "half precision"),
    "cuda_bf16.h": (as_string("include <cuda_bf16.h>"), "half precision"),
    # precision downgrade (KernelBench, fp32)
    "__float2half(": (as_string("y = __float2half(x);"), "half precision"),
    "__float2half_rn(": (as_string("y = __float2half_rn(x);"), "half precision"),
    "(__half) cast": (as_string("y = (__half)x;"), "half precision"),
    "static_cast<half>": (as_string("y = static_cast<half>(x);"), "half precision"),
    "static_cast<__half>": (as_string("y = static_cast< __half >(x);"), "half precision"),
    "NumericConverter<half_t, float>": (as_string("NumericConverter<half_t, float> c;"), "half precision"),
    "LinearCombination<half_t": (as_string("using E = LinearCombination<half_t, 4>;"), "half precision"),
    "type_convert<half_t>": (as_string("y = type_convert<half_t>(x);"), "half precision"),
    "tk::half(": (as_string("y = tk::half(x);"), "half precision"),
    ".float16()": (as_string("y = x.float16()"), "half precision"),
    ".to(torch.float16)": (as_string("y = x.to(torch.float16)"), "half precision"),
    ".to(torch.half)": (as_string("y = x.to(torch.half)"), "half precision"),
    ".to(dtype=torch.half)": (as_string("y = x.to(dtype=torch.half)"), "half precision"),
    "tl.astype float16": (as_string("y = tl.astype(x, tl.float16)"), "half precision"),
    # torch compute layers (existing)
    "nn.Linear": ("layer = torch.nn.Linear(2, 2)\n", "torch compute layer"),
    "nn.Bilinear": (as_string("nn.Bilinear(2, 2, 2)"), "torch compute layer"),
    "nn.LazyLinear": (as_string("nn.LazyLinear(2)"), "torch compute layer"),
    "nn.BatchNorm1d": (as_string("nn.BatchNorm1d(4)"), "torch compute layer"),
    "nn.Softmax": (as_string("nn.Softmax(1)"), "torch compute layer"),
    "nn.functional": (as_string("nn.functional"), "torch compute layer"),
    "F.log_softmax": (as_string("F.log_softmax(x, 1)"), "torch compute layer"),
    "torch.addmm": (as_string("torch.addmm(c, a, b)"), "torch compute layer"),
    "torch.tensordot": (as_string("torch.tensordot(a, b)"), "torch compute layer"),
    "at::matmul": (as_string("at::matmul(a, b)"), "torch compute layer"),
    "torch::mm": (as_string("torch::mm(a, b)"), "torch compute layer"),
    "cublas": (as_string("cublasSgemm(h)"), "torch compute layer"),
    # torch compute layers (KernelBench)
    "torch.nn.ReLU": (as_string("torch.nn.ReLU()"), "torch compute layer"),
    "torch.nn.Sequential": (as_string("torch.nn.Sequential()"), "torch compute layer"),
    "torch.nn.utils": (as_string("torch.nn.utils.parametrize"), "torch compute layer"),
    "torch.nn.Modules": (as_string("torch.nn.Modules"), "torch compute layer"),
    "torch.nn.functional.gelu": (as_string("torch.nn.functional.gelu(x)"), "torch compute layer"),
    "nn.functional.relu": (as_string("nn.functional.relu(x)"), "torch compute layer"),
    "torch.relu followed by space": (as_string("torch.relu (x)"), "torch compute layer"),
    "torch.tanh at the end of a line": ("f = torch.tanh\n", "torch compute layer"),
    "@ outside a _torch_ function": ("def f(a, b):\n    return a @ b\n", "`@` outside"),
    "@ at module level": ("y = torch.ones(2, 2) @ torch.ones(2, 2)\n", "`@` outside"),
    # line breaks other than \n (the harnesses would not see this `pass` as code)
    "carriage return": ("x = 1  # note\rpass\n", "line break other than"),
    "form feed": ("x = 1\x0c\n", "line break other than"),
}

# torch.<op> names KernelBench flags (followed by `(`, whitespace or the end)
TORCH_OPS = (
    "mm bmm matmul einsum conv1d conv2d conv3d conv conv_transpose1d conv_transpose2d conv_transpose3d "
    "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d adaptive_avg_pool2d "
    "adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d relu hardtanh elu selu "
    "leaky_relu gelu softsign softplus softmax log_softmax tanh sigmoid hardsigmoid silu mish batch_norm "
    "group_norm layer_norm instance_norm rms_norm normalize linear cross_entropy kl_div mse_loss huber_loss "
    "triplet_margin_loss cosine_similarity logsumexp clamp dropout"
).split()

# F.<prefix> KernelBench flags (any name starting so)
F_PREFIXES = "conv linear relu gelu softmax batch_norm layer_norm dropout max_pool avg_pool".split()

# torch.nn.<name> KernelBench allows (containers, parameters, init)
NN_ALLOWED = "Module ModuleList ModuleDict Parameter ParameterList ParameterDict parameter init".split()


def test_clean_text_has_no_violation():
    assert violations(CLEAN) == []


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_control(name):
    snippet, fragment = NEGATIVE[name]
    found = flagged(snippet)
    assert any(fragment in v for v in found), f"{name}: expected {fragment!r} in {found}"


@pytest.mark.parametrize("op", TORCH_OPS)
def test_torch_compute_op(op):
    assert any("torch compute layer" in v for v in flagged(as_string(f"y = torch.{op}(x)"))), op


@pytest.mark.parametrize("prefix", F_PREFIXES)
def test_functional_prefix(prefix):
    assert any("torch compute layer" in v for v in flagged(as_string(f"y = F.{prefix}2d_like(x)"))), prefix


@pytest.mark.parametrize("name", NN_ALLOWED)
def test_nn_containers_allowed(name):
    assert flagged(as_string(f"torch.nn.{name}")) == []


def test_violation_names_the_line():
    found = flagged("y = torch.matmul(a, b)\n")
    line = (CLEAN + "\n").count("\n") + 1
    assert found and all(v.startswith(f"line {line}:") for v in found), found


def test_needs_kernel_and_compile_text():
    assert "no __global__ kernel in the text" in violations(CLEAN.replace("__global__", "__device__"))
    no_call = CLEAN.replace("return load_inline(", "return dict(")
    assert violations(no_call) == ["no load_inline(...) call"]
    # a call the AST sees but the harnesses do not: its lines are cut at the `#` in a string
    hidden = ('_h = "#"; from torch.utils.cpp_extension import load_inline\n'
              'K = "__global__"\n'
              'M = "#", load_inline(name="m", cpp_sources="")\n')
    assert violations(hidden) == ["no load_inline or cpp_extension in the text"]
    # a kernel named only in a comment does not count
    commented = CLEAN.replace("__global__ void", "void").replace('r"""\n', 'r"""  // __global__\n', 1)
    assert "no __global__ kernel in the text" in violations(commented)


def test_comment_tails_are_ignored():
    tails = ("x = 1  # try except pass float16 torch.matmul threading nn.Linear\n"
             "_K = 'y = 1;  // __half torch.cuda.Stream() static_cast<half> time.time = f'\n"
             "_L = 'z'  # _make_subclass class X(torch.Tensor) ThreadPoolExecutor\n")
    assert violations(CLEAN + "\n" + tails) == []
    # the cut is at the first `#` or `//`, whichever comes first on the line
    assert violations(CLEAN + "\n_M = 'a // b # pass'\n_N = 'a # b // pass'\n") == []


def test_matmul_operator_only_in_torch_path():
    ok = ("def _torch_gemm_nt(a, b):\n"
          "    prod = lambda u, v: u @ v\n"
          "    return (a @ b.t()).contiguous() + prod(a, b.t())\n")
    assert flagged(ok) == []
    for bad in ("def _cpu_gemm_nt(a, b):\n    return a @ b.t()\n",   # the old exemption is gone
                "def torch_gemm(a, b):\n    return a @ b.t()\n",
                "def gemm(a, b):\n    return a @ b.t()\n"):
        found = flagged(bad)
        assert found and all("`@` outside" in v for v in found), (bad, found)
    # only the lines of the _torch_ function are exempt
    mixed = ok + "\n\ndef gemm(a, b):\n    return a @ b\n"
    assert len(flagged(mixed)) == 1
