"""The programmatic-dependent-launch rule of kernels/pdl.cuh, checked in the
sources (CPU only).  A kernel launched with launch_kernel() may be launched
while the kernel before it on the stream still runs, so before it touches
global memory it must wait (pdl_wait_then_release()); a kernel that forgot
would read its inputs before they are written, silently.  So: every .cu or .cuh file of kernels/
that includes pdl.cuh launches only through launch_kernel() (no <<<>>>), and
every __global__ function it defines starts with pdl_wait_then_release().
Negative controls: the checker flags a kernel whose first statement is another
one, and a <<<>>> launch."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_DIR = os.path.join(REPO, "kernels")


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def pdl_rule_violations(name, text):
    """Messages for each break of the rule in one .cu file's text (none if it does not include pdl.cuh)."""
    if '#include "pdl.cuh"' not in text:
        return []
    code = _strip_comments(text)
    problems = [f"{name}: <<<>>> launch (use launch_kernel)" for _ in re.finditer(r"<<<", code)]
    for match in re.finditer(r"__global__", code):
        body = code.index("{", match.end())
        head = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", code[match.end():body])
        kernel = re.search(r"(\w+)\s*\(", head).group(1)
        first = code[body + 1:].lstrip().split(";", 1)[0].strip()
        if first != "pdl_wait_then_release()":
            problems.append(f"{name}: kernel {kernel} starts with `{first[:60]};`, not pdl_wait_then_release();")
    return problems


def _sources():
    for name in sorted(os.listdir(KERNEL_DIR)):
        if name.endswith((".cu", ".cuh")):  # .cuh: kernels shared by both extensions (softmax_backward.cuh)
            with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
                yield name, f.read()


def test_kernels_launched_with_pdl_wait_first():
    checked = [name for name, text in _sources() if '#include "pdl.cuh"' in text]
    # The files whose kernels run around the fp16x3 GEMM (pdl.cuh's header).
    assert {"prepass_fp16x3.cu", "bn_apply.cu", "bn_softmax.cu", "bn_backward.cu", "softmax_backward.cuh",
            "prepass_fp16x3_backward.cu"} <= set(checked)
    problems = [p for name, text in _sources() for p in pdl_rule_violations(name, text)]
    assert problems == []


def test_checker_flags_a_kernel_without_the_wait_and_a_plain_launch():
    with open(os.path.join(KERNEL_DIR, "bn_apply.cu"), encoding="utf-8") as f:
        text = f.read()
    assert pdl_rule_violations("bn_apply.cu", text) == []
    moved = text.replace("bn_apply_kernel(const BnApplyArgs p) {\n  pdl_wait_then_release();",
                         "bn_apply_kernel(const BnApplyArgs p) {\n  const int early = 0;\n  pdl_wait_then_release();", 1)
    assert moved != text
    assert any("bn_apply_kernel starts with `const int early = 0;`" in p
               for p in pdl_rule_violations("bn_apply.cu", moved))
    plain = text + "\nvoid extra(cudaStream_t s) { bn_fold_kernel<<<1, 1, 0, s>>>(BnApplyArgs{}); }\n"
    assert pdl_rule_violations("bn_apply.cu", plain) == ["bn_apply.cu: <<<>>> launch (use launch_kernel)"]
