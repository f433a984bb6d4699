"""The rules benchmark harnesses apply to a submitted model file, as a checker.

Harnesses scan the whole text of the file with regular expressions (strings and
docstrings included; only `#` and `//` comment tails are removed: each line is
cut at its first `#`, then at its first `//`), so the rules below are checked
the same way; the ones a regex cannot state precisely (which call is
`load_inline`, where `@` is used, what is assigned to) are also checked on the
AST.  `violations(text)` returns one line per broken rule, empty when the file
is acceptable.  Used by tools/bundle.py (it refuses to write a violating
bundle) and by tests/test_bundle.py; tests/test_harness_rules.py has a negative
control per rule.

The rules cover everything KernelBench's static checker
(kernel_static_checker.validate_kernel_static, backend "cuda", precision
"fp32") reports, as an error or as a warning, and more: a file with no
violations here passes that checker with no errors and no warnings.

Rules
  - no try statement; the words `try`, `except`, `pass` nowhere outside comments
  - a `__global__` kernel, a `load_inline(...)` call, and the text `load_inline`
    or `cpp_extension` outside comments
  - no assignment to (or setattr on) anything under torch, time, timeit: no
    monkey-patched timing functions; the texts `torch.cuda.Event[.record |
    .elapsed_time] =`, `torch.cuda.synchronize =`, `time.time =`,
    `time.perf_counter =` nowhere (`==` included, any prefix before `time.`)
  - no threads, processes or extra CUDA streams: `threading`, `multiprocessing`,
    `concurrent.futures`, `*PoolExecutor`, `asyncio`, `torch.cuda.Stream`,
    `cuda.Stream`, `torch.cuda.stream`, `wait_stream`, `record_stream`, ...
  - no lazy / deferred tensors (tensor subclasses: `class X(... torch.Tensor)`
    or `(Tensor)` on one line, `_make_subclass`, `torch.Tensor.__new__`,
    torch._lazy, jit.fork)
  - no half-precision types, conversions or autocast (`float16`, `bfloat16`,
    `torch.half`, `.half(`, `__half`, `__float2half*`, `static_cast<half>`,
    `half_t`, `tk::half`, ...)
  - no torch compute layers or ops by name: `torch.nn.` followed by anything
    but Module, ModuleList, ModuleDict, Parameter, ParameterList,
    ParameterDict, parameter, init; `nn.Linear`, `nn.BatchNorm*`,
    `nn.functional`; `F.conv*`, `F.linear`, `F.relu*`, `F.softmax*`, ...;
    `torch.<op>` for the matrix products, convolutions, poolings, activations,
    normalizations, losses, `linear`, `logsumexp`, `clamp`, `dropout`
    (`_TORCH_OPS`); `at::`/`torch::` matmul-like ops; cuBLAS
  - the matrix-product operator `@` only inside the plain-PyTorch functions
    (`_torch_*`: the CPU path and the float64 CUDA path)
  - line breaks are `\\n` only (no `\\r`, form feed, ...): the harnesses split
    lines on `\\n`, Python and str.splitlines on more
"""
import ast
import re

_WORDS = ("try", "except", "pass")

# torch.<op> names the harnesses treat as compute (with our additions addmm, tensordot)
_TORCH_OPS = (
    ["mm", "bmm", "addmm", "matmul", "einsum", "tensordot", "linear",
     "conv", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"]
    + [f"{kind}_pool{d}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max") for d in (1, 2, 3)]
    + ["relu", "hardtanh", "elu", "selu", "leaky_relu", "gelu", "softsign", "softplus", "softmax",
       "log_softmax", "tanh", "sigmoid", "hardsigmoid", "silu", "mish",
       "batch_norm", "group_norm", "layer_norm", "instance_norm", "rms_norm", "normalize",
       "cross_entropy", "kl_div", "mse_loss", "huber_loss", "triplet_margin_loss", "cosine_similarity",
       "logsumexp", "clamp", "dropout"]
)
_NN_CONTAINERS = ("Module", "ModuleList", "ModuleDict", "Parameter", "ParameterList", "ParameterDict",
                  "parameter", "init")

_FORBIDDEN_TEXT = {
    "timing monkey-patch": [r"\bsetattr\s*\(\s*(torch|time|timeit)\b", r"\b(time|timeit)\.\w+\s*=[^=]",
                            r"torch\.cuda\.(Event|synchronize)\s*=[^=]", r"elapsed_time\s*=[^=]",
                            r"torch\.cuda\.(Event(\.record|\.elapsed_time)?|synchronize)\s*=",
                            r"time\.(time|perf_counter)\s*="],
    "threads or extra streams": [r"threading", r"multiprocessing", r"concurrent\.futures",
                                 r"(Thread|Process)PoolExecutor", r"\bThread\s*\(", r"\basyncio\b",
                                 r"torch\.cuda\.Stream\b", r"cuda\.Stream\b", r"torch\.cuda\.stream",
                                 r"\b(wait|record)_stream\b", r"\bcudaStreamCreate", r"getStreamFromPool"],
    "lazy or deferred tensors": [r"torch\._lazy", r"\bLazyTensor", r"__torch_function__", r"__torch_dispatch__",
                                 r"torch\.jit\.fork", r"_make_subclass", r"class\s+\w+.*\((torch\.)?Tensor\)",
                                 r"torch\.Tensor\.__new__"],
    "half precision": [r"\bfloat16\b", r"\bbfloat16\b", r"\.half\s*\(", r"\bautocast\b", r"__half\b",
                       r"__nv_bfloat16", r"cuda_fp16\.h", r"cuda_bf16\.h", r"\btorch\.half\b",
                       r"__float2half", r"static_cast\s*<\s*(__)?half\s*>", r"\bhalf_t\b", r"tk::half\b"],
    "torch compute layer": [r"torch\.nn\.(?!(%s)\b)" % "|".join(_NN_CONTAINERS),
                            r"\bnn\.(Linear|Bilinear|LazyLinear|BatchNorm\w*|Softmax|functional)\b",
                            r"\bF\.(conv|linear|relu|gelu|softmax|log_softmax|batch_norm|layer_norm|dropout"
                            r"|max_pool|avg_pool)",
                            r"\btorch\.(%s)\b" % "|".join(sorted(_TORCH_OPS, key=len, reverse=True)),
                            r"\b(at|torch)::(matmul|mm|addmm|bmm|linear|batch_norm|softmax)\b", r"\bcublas"],
}

# the text must contain each of these (outside comments)
_REQUIRED_TEXT = {
    "no __global__ kernel in the text": r"__global__",
    "no load_inline or cpp_extension in the text": r"load_inline|cpp_extension",
}

# line breaks that str.splitlines and Python honour but the harnesses (split on "\n") do not
_OTHER_LINE_BREAKS = r"[\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]"

_PATCH_ROOTS = {"torch", "time", "timeit"}
_TORCH_PATH_PREFIX = "_torch_"


def strip_comments(text):
    """Each line (split on "\\n") up to its first `#` or `//`, as the harness checkers do."""
    return "\n".join(re.split(r"#|//", line, maxsplit=1)[0] for line in text.split("\n"))


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _call_name(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _ast_violations(tree):
    out = []
    torch_path_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith(_TORCH_PATH_PREFIX):
            torch_path_lines.update(range(node.lineno, node.end_lineno + 1))
    saw_load_inline = False
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            out.append(f"line {line}: try statement")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _root_name(t) in _PATCH_ROOTS:
                    out.append(f"line {line}: assignment to {ast.unparse(t)} (monkey-patch)")
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name == "load_inline":
                saw_load_inline = True
            if name == "setattr" and node.args and _root_name(node.args[0]) in _PATCH_ROOTS:
                out.append(f"line {line}: setattr on {ast.unparse(node.args[0])} (monkey-patch)")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] in {"threading", "multiprocessing", "concurrent", "asyncio", "_thread"}:
                    out.append(f"line {line}: import of {m} (threads or processes)")
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)
              and node.lineno not in torch_path_lines):
            out.append(f"line {line}: `@` outside the plain-PyTorch path (`{_TORCH_PATH_PREFIX}*` functions)")
    if not saw_load_inline:
        out.append("no load_inline(...) call")
    return out


def violations(text):
    """Every broken rule in the Python file `text`, one string each."""
    out = []

    def line_of(s, m):
        return s.count("\n", 0, m.start()) + 1

    for m in re.finditer(_OTHER_LINE_BREAKS, text):
        out.append(f"line {line_of(text, m)}: line break other than \\n: {m.group(0)!r}")
    code = strip_comments(text)
    for word in _WORDS:
        for m in re.finditer(rf"\b{word}\b", code):
            out.append(f"line {line_of(code, m)}: the word `{word}` outside a comment")
    for message, pattern in _REQUIRED_TEXT.items():
        if not re.search(pattern, code):
            out.append(message)
    for rule, patterns in _FORBIDDEN_TEXT.items():
        for pattern in patterns:
            for m in re.finditer(pattern, code):
                out.append(f"line {line_of(code, m)}: {rule}: `{m.group(0)}`")
    out.extend(_ast_violations(ast.parse(text)))
    return out
