"""The self-contained bundle (dist/model_new.py) and model_new.py executed the way
harnesses execute model files.  CPU-only; runs in CI.

  - the bundle is fresh: tools/bundle.py renders exactly the committed text, and
    its embedded kernels are byte-identical to kernels/* (read from the AST)
  - the bundle and model_new.py follow the harness rules (tools/harness_rules.py:
    regexes over the comment-stripped text plus AST checks); negative controls:
    each rule fires on a text that breaks it
  - reference + bundle executed into one namespace: the reference's names
    (sizes, Model, its get_inputs) keep their meaning, also at other sizes, and
    ModelNew built after the same seed equals Model (state_dict bits, CPU forward)
  - model_new.py executed from its text finds kernels/ through
    $FUSED_GEMM_BN_KERNEL_DIR or ./kernels, and says what to set when it cannot
  - the bundle imports alone from an empty folder in a fresh interpreter
  - extension name: deterministic, changes with any source byte or flag;
    build folder under $TORCH_EXTENSIONS_DIR
"""
import ast
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.harness import BUNDLE, MODEL_NEW, REPO, exec_texts, read, reference_text
from tools import bundle
from tools.harness_rules import violations

KERNEL_DIR = os.path.join(REPO, "kernels")


def embedded_sources(text):
    """The literal assigned to _EMBEDDED_SOURCES in `text`, evaluated from the AST."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EMBEDDED_SOURCES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no _EMBEDDED_SOURCES assignment")


def test_bundle_is_fresh():
    assert os.path.exists(BUNDLE), "dist/model_new.py missing: run python tools/bundle.py"
    assert read(BUNDLE) == bundle.render(), "dist/model_new.py is stale: run python tools/bundle.py"


def test_bundle_kernels_byte_identical():
    embedded = embedded_sources(read(BUNDLE))
    on_disk = sorted(n for n in os.listdir(KERNEL_DIR) if n.endswith((".cu", ".cuh", ".cpp")))
    assert sorted(embedded) == on_disk
    for name in on_disk:
        with open(os.path.join(KERNEL_DIR, name), "rb") as f:
            assert embedded[name].encode("utf-8") == f.read(), f"{name} differs from kernels/{name}"
    assert embedded_sources(read(MODEL_NEW)) is None


@pytest.mark.parametrize("path", [BUNDLE, MODEL_NEW], ids=["bundle", "model_new"])
def test_follows_harness_rules(path):
    text = read(path)
    if path == MODEL_NEW:  # its kernels live in kernels/, not in its text
        text += "\n_K = '__global__'\n"
    assert violations(text) == []


BREAKERS = {
    "try statement": "try:\n    x = 1\nexcept ValueError:\n    x = 2\n",
    "word pass": "def f():\n    pass\n",
    "word except in a string": "MSG = 'everything except this'\n",
    "nn.Linear": "layer = torch.nn.Linear(2, 2)\n",
    "matmul": "y = torch.matmul(a, b)\n",
    "batch_norm": "y = torch.nn.functional.batch_norm(a, m, v)\n",
    "@ outside the CPU path": "def f(a, b):\n    return a @ b\n",
    "timing patch": "import time\ntime.perf_counter = lambda: 0.0\n",
    "event patch": "setattr(torch.cuda, 'Event', None)\n",
    "thread": "import threading\n",
    "stream": "s = torch.cuda.Stream()\n",
    "half": "y = x.half()\n",
    "bf16": "y = x.to(torch.bfloat16)\n",
    "lazy": "class T(torch.Tensor):\n    __torch_function__ = None\n",
}


@pytest.mark.parametrize("name", sorted(BREAKERS))
def test_rule_checker_negative_controls(name):
    base = read(BUNDLE)
    assert violations(base) == []
    broken = violations(base + "\n" + BREAKERS[name])
    assert broken, f"the checker missed: {name}"


def test_rule_checker_needs_kernel_and_load_inline():
    assert any("__global__" in v for v in violations("import torch\n"))
    assert any("load_inline" in v for v in violations("import torch\nK = '__global__'\n"))
    # comment tails are ignored, as by the harnesses
    assert violations("from torch.utils.cpp_extension import load_inline  # try pass\n"
                      "K = '__global__ void f() {}  // except'\nload_inline()\n") == []


@pytest.mark.parametrize("sizes", [{}, {"batch_size": 48, "in_features": 40, "out_features": 24}],
                         ids=["kernelbench", "other_sizes"])
def test_shared_namespace_keeps_reference_meaning(sizes):
    """Reference first, then the bundle, into one namespace: every name the
    reference defined keeps its value; the reference's own get_inputs still
    makes its sizes; ModelNew(*get_init_inputs()) after the same seed has the
    reference's parameters bit for bit and computes the same output on CPU."""
    ref_text = reference_text(**sizes)
    ref_ns = exec_texts(ref_text)
    ns = exec_texts(ref_text, read(BUNDLE))
    for name in ("batch_size", "in_features", "out_features", "scale_shape"):
        assert ns[name] == ref_ns[name], name
    ref_get_inputs = exec_texts(ref_text)["get_inputs"]
    assert "Model" not in exec_texts(read(BUNDLE)), "the bundle must not define or replace Model"
    assert [t.shape for t in ns["get_inputs"]()] == [t.shape for t in ref_get_inputs()]
    assert ns["get_init_inputs"]() == ref_ns["get_init_inputs"]()
    if sizes:  # a full-size CPU forward is slow; the small sizes check the numbers
        init = ns["get_init_inputs"]()
        torch.manual_seed(3)
        model = ns["Model"](*init).double()
        torch.manual_seed(3)
        model_new = ns["ModelNew"](*init).double()
        assert list(model.state_dict()) == list(model_new.state_dict())
        for (k, a), (_, b) in zip(model.state_dict().items(), model_new.state_dict().items()):
            assert torch.equal(a, b), k
        torch.manual_seed(4)
        x = ns["get_inputs"]()[0].double()
        x_before = x.clone()
        torch.testing.assert_close(model_new(x), model(x), rtol=1e-10, atol=1e-10)
        assert torch.equal(x, x_before)


def test_model_new_exec_from_text_finds_kernels(tmp_path, monkeypatch):
    text = read(MODEL_NEW)
    monkeypatch.delenv("FUSED_GEMM_BN_KERNEL_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="FUSED_GEMM_BN_KERNEL_DIR"):
        exec_texts(text)
    monkeypatch.setenv("FUSED_GEMM_BN_KERNEL_DIR", KERNEL_DIR)
    ns = exec_texts(text)
    assert sorted(ns["_KERNEL_SOURCES"]) == sorted(embedded_sources(read(BUNDLE)))
    monkeypatch.delenv("FUSED_GEMM_BN_KERNEL_DIR")
    shutil.copytree(KERNEL_DIR, tmp_path / "kernels")
    assert exec_texts(text)["_KERNEL_SOURCES"] == ns["_KERNEL_SOURCES"]


def test_bundle_imports_alone_in_empty_folder(tmp_path):
    shutil.copy(BUNDLE, tmp_path / "model_new.py")
    env = {k: v for k, v in os.environ.items() if k != "FUSED_GEMM_BN_KERNEL_DIR"}
    code = ("import model_new, torch; m = model_new.ModelNew(8, 6, (6,)); "
            "print(tuple(m(torch.rand(4, 8)).shape), len(model_new._KERNEL_SOURCES))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["(4,", "6)", str(len(embedded_sources(read(BUNDLE))))]


def test_extension_name_and_build_directory(tmp_path, monkeypatch):
    ns = exec_texts(read(BUNDLE))
    sources = ns["_KERNEL_SOURCES"]
    flags = ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    name = ns["_extension_name"](sources, flags)
    assert name == ns["_extension_name"](dict(reversed(list(sources.items()))), flags)
    assert name.startswith("fused_gemm_bn_") and len(name) == len("fused_gemm_bn_") + 16
    changed = dict(sources)
    changed["bn_apply.cu"] += " "
    assert ns["_extension_name"](changed, flags) != name
    assert ns["_extension_name"](sources, flags[:1] + ["-gencode=arch=compute_80,code=sm_80"]) != name
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ns["_build_directory"](name) == os.path.join(str(tmp_path), name)
    assert os.path.isdir(tmp_path / name)
    ns["_write_headers"](str(tmp_path / name / "include"), sources)
    for header in (n for n in sources if n.endswith(".cuh")):
        assert (tmp_path / name / "include" / header).read_text() == sources[header]
