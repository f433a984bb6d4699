"""tools/ab_kernels.py's loading, which runs without a GPU (CPU, CI): a second copy of
model_new.py reads its kernel sources, and its 16-bit extra's, from the folder it was
given and from nowhere else, leaves $FUSED_GEMM_BN_KERNEL_DIR as it was, and problem
84's module text binds to the copy it is executed against.  The timings need a GPU and
are not tested here."""
import os
import shutil
import sys
import uuid

import pytest
import torch

from tools import ab_kernels

MARKER = "// ab_kernels test marker"


def _load_pair(tmp_path, monkeypatch, marked):
    """{"new": the checkout's kernels, "base": a copy with MARKER appended to the files `marked`
    (paths under kernels/)}, loaded with $FUSED_GEMM_BN_KERNEL_DIR set to something else,
    which must be left as it was."""
    base_dir = tmp_path / "kernels"
    shutil.copytree(os.path.join(ab_kernels.ROOT, "kernels"), base_dir)
    for name in marked:
        with open(base_dir / name, "a", encoding="utf-8") as f:
            f.write("\n" + MARKER + "\n")
    monkeypatch.setenv(ab_kernels.KERNEL_DIR_ENV, "/nonexistent/left/alone")
    tag = uuid.uuid4().hex[:8]
    pair = {"new": ab_kernels.load_engine(f"ab_test_new_{tag}", None),
            "base": ab_kernels.load_engine(f"ab_test_base_{tag}", str(base_dir))}
    assert os.environ[ab_kernels.KERNEL_DIR_ENV] == "/nonexistent/left/alone"
    return pair


@pytest.fixture
def modules_removed():
    """The modules a test registered (engine copies, their extras) are removed afterwards."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.fixture
def engines(tmp_path, monkeypatch, modules_removed):
    return _load_pair(tmp_path, monkeypatch, ["launchers.cuh", os.path.join("lowp", "bn_16bit.cu")])


def test_each_copy_reads_its_own_kernels(engines):
    """The 16-bit extension's sources: kernels/lowp/'s files and the kernels/ headers they include
    (launchers.cuh among them), so both folders of the copy are seen."""
    for side, engine in engines.items():
        sources = engine.extra("model_new_lowp").sources()
        for name in ("bn_16bit.cu", "launchers.cuh"):
            assert (MARKER in sources[name]) == (side == "base"), (side, name)
    assert engines["base"].extra("model_new_lowp") is not engines["new"].extra("model_new_lowp")


def test_problem_84_binds_to_the_copy_it_runs_against(engines):
    for side, engine in engines.items():
        classes = ab_kernels.module_classes(engine)
        assert classes["33"] is engine.ModelNew
        assert issubclass(classes["84"], engine.FusedModule)
        assert classes["84"].scale_after_bn and not getattr(classes["33"], "scale_after_bn", False)
        torch.manual_seed(0)
        model = classes["84"](16, 8).eval()
        y = model(torch.rand(3, 16))
        assert y.shape == (3, 8) and torch.allclose(y.sum(dim=1), torch.ones(3))
    assert "model_new" not in sys.modules or sys.modules["model_new"] not in engines.values()


def test_a_taken_name_is_refused(engines):
    with pytest.raises(RuntimeError, match="is taken"):
        ab_kernels.load_engine(engines["new"].__name__, None)


def test_parse_args_requires_a_base():
    with pytest.raises(SystemExit):
        ab_kernels.parse_args([])
    args = ab_kernels.parse_args(["--base", "HEAD", "--shape", "2,8,4", "--shape", "4,8,8"])
    assert args.shape == [(2, 8, 4), (4, 8, 8)] and args.model == "both" and args.dtype == "float16"


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="operators need torch.library.custom_op (2.4+)")
def test_copies_differing_in_the_16bit_kernels_alone_do_not_share_operators(tmp_path, monkeypatch, modules_removed):
    """A copy whose kernels/lowp/ differs runs other 16-bit kernels, so it must not reuse the
    first copy's fused_gemm_bn:: operators (whose forward_* dispatch 16-bit calls to the
    registering copy's extension); one with the same files shares them."""
    pair = _load_pair(tmp_path, monkeypatch, [os.path.join("lowp", "bn_16bit.cu")])
    assert pair["base"]._OP_NAMESPACE != pair["new"]._OP_NAMESPACE
    same = ab_kernels.load_engine(f"ab_test_same_{uuid.uuid4().hex[:8]}", None)
    assert same._OP_NAMESPACE == pair["new"]._OP_NAMESPACE


def test_a_base_tree_runs_its_own_python(tmp_path, monkeypatch, modules_removed):
    """--base-tree: the base side imports the tree's model_new.py, which binds the tree's own
    extras (here a model_new_lowp.py with an extra name, as a changed FUNCTIONS list would be)
    and reads the tree's kernels; problem 84's class comes from the tree's file."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in os.listdir(ab_kernels.ROOT):
        if name.startswith("model_new") and name.endswith(".py"):
            shutil.copy(os.path.join(ab_kernels.ROOT, name), tree / name)
    shutil.copytree(os.path.join(ab_kernels.ROOT, "kernels"), tree / "kernels")
    shutil.copytree(os.path.dirname(ab_kernels.PROBLEM_84_FILE), tree / os.path.dirname(ab_kernels.PROBLEM_84_RELATIVE),
                    ignore=shutil.ignore_patterns("__pycache__", "dist"))
    with open(tree / "model_new_lowp.py", "a", encoding="utf-8") as f:
        f.write("\nAB_TEST_TREE = True\n")
    with open(tree / "kernels" / "lowp" / "bn_16bit.cu", "a", encoding="utf-8") as f:
        f.write("\n" + MARKER + "\n")
    monkeypatch.setenv(ab_kernels.KERNEL_DIR_ENV, "/nonexistent/left/alone")
    tag = uuid.uuid4().hex[:8]
    new = ab_kernels.load_engine(f"ab_test_new_{tag}", None)
    base = ab_kernels.load_engine(f"ab_test_tree_{tag}", None, root=str(tree))
    assert os.environ[ab_kernels.KERNEL_DIR_ENV] == "/nonexistent/left/alone"
    assert getattr(base.extra("model_new_lowp"), "AB_TEST_TREE", False)
    assert not hasattr(new.extra("model_new_lowp"), "AB_TEST_TREE")
    assert MARKER in base.extra("model_new_lowp").sources()["bn_16bit.cu"]
    assert MARKER not in new.extra("model_new_lowp").sources()["bn_16bit.cu"]
    classes = ab_kernels.module_classes(base, str(tree / ab_kernels.PROBLEM_84_RELATIVE))
    assert issubclass(classes["84"], base.FusedModule) and classes["33"] is base.ModelNew
    args = ab_kernels.parse_args(["--base-tree", str(tree)])
    assert args.base_tree == str(tree) and args.base is None and args.base_dir is None


def test_autocast_option_needs_float32_models():
    """--autocast times float32 models inside torch.autocast: another --dtype is refused."""
    with pytest.raises(SystemExit):
        ab_kernels.parse_args(["--base", "HEAD", "--autocast", "float16"])  # (--dtype defaults to float16)
    args = ab_kernels.parse_args(["--base", "HEAD", "--dtype", "float32", "--autocast", "bfloat16"])
    assert args.autocast == "bfloat16"
    seen = []
    ab_kernels.in_region(lambda x: seen.append(torch.is_autocast_cpu_enabled()), None)(0)
    assert seen == [False]


def test_backward_option_times_steps_that_clear_their_gradients(monkeypatch):
    """--backward implies --grad; as_steps' calls run forward + backward with one fixed g, and
    each side's prepare clears x's and its model's gradients before running the side's own."""
    args = ab_kernels.parse_args(["--base", "HEAD", "--dtype", "float32", "--backward"])
    assert args.backward and args.grad
    monkeypatch.setattr(ab_kernels.bench, "DEVICE", "cpu")
    models = {s: torch.nn.Linear(3, 2) for s in ("eager", "new", "base")}
    ran = []
    steps, clears = ab_kernels.as_steps(dict(models), models, {"new": lambda x: ran.append("new")}, 4, 2,
                                        torch.float32, seed=0)
    x = torch.randn(4, 3, requires_grad=True)
    for s in models:
        steps[s](x)
        assert x.grad is not None and models[s].weight.grad is not None
        clears[s](x)
        assert x.grad is None and models[s].weight.grad is None
    assert ran == ["new"]
    grads = []
    for _ in range(2):  # one fixed g: the same gradient each call
        steps["eager"](x)
        grads.append(models["eager"].weight.grad.clone())
        clears["eager"](x)
    assert torch.equal(grads[0], grads[1])
