"""The rules benchmark harnesses apply to a submitted model file, as a checker.

Harnesses scan the whole text of the file with regular expressions (strings and
docstrings included; only `#` and `//` comment tails are removed), so the rules
below are checked the same way; the ones a regex cannot state precisely (which
call is `load_inline`, where `@` is used, what is assigned to) are also checked
on the AST.  `violations(text)` returns one line per broken rule, empty when
the file is acceptable.  Used by tools/bundle.py (it refuses to write a
violating bundle) and by tests/test_bundle.py.

Rules
  - no try statement; the words `try`, `except`, `pass` nowhere outside comments
  - a `__global__` kernel and a `load_inline(...)` call
  - no assignment to (or setattr on) anything under torch, time, timeit: no
    monkey-patched timing functions
  - no threads, processes or extra CUDA streams
  - no lazy / deferred tensors (tensor subclasses, torch._lazy, jit.fork)
  - no half-precision types or autocast
  - no torch compute layers (Linear, BatchNorm, matmul, softmax, ...) by name;
    the matrix-product operator `@` only inside the CPU-path functions (`_cpu_*`)
"""
import ast
import re

_WORDS = ("try", "except", "pass")

_FORBIDDEN_TEXT = {
    "timing monkey-patch": [r"\bsetattr\s*\(\s*(torch|time|timeit)\b", r"\b(time|timeit)\.\w+\s*=[^=]",
                            r"torch\.cuda\.(Event|synchronize)\s*=[^=]", r"elapsed_time\s*=[^=]"],
    "threads or extra streams": [r"\bthreading\b", r"\bmultiprocessing\b", r"\bconcurrent\.futures\b",
                                 r"\bThread\s*\(", r"torch\.cuda\.Stream\b", r"torch\.cuda\.stream\s*\(",
                                 r"\bcudaStreamCreate", r"getStreamFromPool", r"\basyncio\b"],
    "lazy or deferred tensors": [r"torch\._lazy", r"\bLazyTensor", r"__torch_function__", r"__torch_dispatch__",
                                 r"torch\.jit\.fork", r"_make_subclass"],
    "half precision": [r"\bfloat16\b", r"\bbfloat16\b", r"\.half\s*\(", r"\bautocast\b", r"__half\b",
                       r"__nv_bfloat16", r"cuda_fp16\.h", r"cuda_bf16\.h"],
    "torch compute layer": [r"\bnn\.(Linear|Bilinear|LazyLinear|BatchNorm\w*|Softmax|functional)\b",
                            r"\bF\.(linear|batch_norm|softmax|log_softmax)\b",
                            r"\btorch\.(matmul|mm|bmm|addmm|einsum|tensordot|batch_norm|softmax|linear)\b",
                            r"\b(at|torch)::(matmul|mm|addmm|bmm|linear|batch_norm|softmax)\b", r"\bcublas"],
}

_PATCH_ROOTS = {"torch", "time", "timeit"}


def strip_comments(text):
    """Each line up to its first `#` or `//`, as the harness checkers do."""
    return "\n".join(re.split(r"#|//", line, maxsplit=1)[0] for line in text.splitlines())


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _call_name(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _ast_violations(tree):
    out = []
    cpu_path_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_cpu"):
            cpu_path_lines.update(range(node.lineno, node.end_lineno + 1))
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
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and node.lineno not in cpu_path_lines:
            out.append(f"line {line}: `@` outside the CPU path (`_cpu_*` functions)")
    if not saw_load_inline:
        out.append("no load_inline(...) call")
    return out


def violations(text):
    """Every broken rule in the Python file `text`, one string each."""
    out = []
    code = strip_comments(text)
    for word in _WORDS:
        for m in re.finditer(rf"\b{word}\b", code):
            out.append(f"line {code.count(chr(10), 0, m.start()) + 1}: the word `{word}` outside a comment")
    if not re.search(r"__global__", code):
        out.append("no __global__ kernel in the text")
    for rule, patterns in _FORBIDDEN_TEXT.items():
        for pattern in patterns:
            for m in re.finditer(pattern, code):
                out.append(f"line {code.count(chr(10), 0, m.start()) + 1}: {rule}: `{m.group(0)}`")
    out.extend(_ast_violations(ast.parse(text)))
    return out
