"""What benchmark harnesses do with a model file, as plain functions for the
tests: execute the reference's text and then the candidate's text into one
fresh namespace (no __file__, no module import), optionally with the
reference's module-level sizes changed.  Both problems: PROBLEMS names each
one's reference, module file and self-contained file."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "reference.py")
MODEL_NEW = os.path.join(REPO, "model_new.py")
BUNDLE = os.path.join(REPO, "dist", "model_new.py")
FOLDER_84 = os.path.join(REPO, "level2_84_gemm_batchnorm_scaling_softmax")
# problem -> (reference.py, model_new.py, self-contained file)
PROBLEMS = {
    "33": (REFERENCE, MODEL_NEW, BUNDLE),
    "84": (os.path.join(FOLDER_84, "reference.py"), os.path.join(FOLDER_84, "model_new.py"),
           os.path.join(FOLDER_84, "dist", "model_new.py")),
}

KERNELBENCH_SIZES = {"batch_size": 1024, "in_features": 8192, "out_features": 8192}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def reference_text(problem="33", **sizes):
    """The problem's reference.py text with module-level assignments replaced,
    e.g. reference_text(batch_size=300, in_features=1000): the way a harness
    reuses one model file at another size.  Assignments may share a line
    (`batch_size = 1024; in_features = 8192`)."""
    text = read(PROBLEMS[problem][0])
    for name, value in sizes.items():
        text, n = re.subn(rf"(^|; *){name} = [^;\n]*", rf"\g<1>{name} = {value!r}", text, count=1, flags=re.M)
        assert n == 1, f"problem {problem}'s reference.py has no assignment `{name} = ...`"
    return text


def exec_texts(*texts):
    """A fresh namespace with each text compiled as "<string>" and executed in
    order, as `exec(compile(src, "<string>", "exec"), ns)`."""
    ns = {"__name__": "__harness__"}
    for text in texts:
        exec(compile(text, "<string>", "exec"), ns)
    return ns
