"""The files work wherever a user puts them (issue: any import name, vendored,
two copies in one process).  Each case runs in a fresh interpreter (its own
sys.modules) over a copy of the repository's files in tmp_path:

  - test_cpu_vendored_package: model_new*.py, kernels/ and problem 84's folder
    copied into a package `mypkg`; `import mypkg.model_new` loads its three extras
    as mypkg.model_new_{sync,lowp,autocast}, each bound to that core's ENGINE, and
    problem 84's module imports the vendored core (not the repository's).
  - test_cpu_import_by_path_and_script: importlib by path under another name
    ("othername": extras othername_*), `python -m` (the core as __main__), and a
    script beside the files.
  - test_cpu_two_copies_in_one_process: the repository's core and a vendored copy
    in one process: each has its own extras, bound to itself, both compute Model's
    function; identical copies share the custom operators' namespace
    (fused_gemm_bn_<the engine's identity>), a copy whose files differ gets its own.
  - test_cpu_compile_cache_of_another_version: two versions of the files, one after
    the other with one torch.compile cache folder: the second compiles its own
    backward (the namespace differs), not the first one's cached graph.
  - test_cpu_exported_program_in_another_process: torch.export.save in one process,
    load in another of the same files: same namespace, same output.
  - test_cpu_missing_extra (negative control): with model_new_lowp.py deleted the
    copy has no 16-bit extra, and the error of a 16-bit CUDA call names the
    missing file, not "self-contained"; with model_new_sync.py deleted the
    warning under torch.distributed names that file.
  - test_gpu_vendored_16bit_and_autocast: through a vendored copy, float16 and
    bfloat16 modules run the 16-bit kernels and match Model; under autocast the
    fused 16-bit path runs (lowp_sm90_autocast_*) and matches Model under autocast.
  - test_gpu_two_differing_copies_16bit: the repository's core and a copy whose
    16-bit kernel sources differ (two 16-bit extensions in one process) both run
    problem 84's training softmax at 8192 features (the walking row kernel, whose
    shared memory needs cudaFuncSetAttribute per extension): the same output.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER_84 = "level2_84_gemm_batchnorm_scaling_softmax"
CORE_FILES = ("model_new.py", "model_new_sync.py", "model_new_lowp.py", "model_new_autocast.py", "reference.py")
EXTRAS = ("sync", "lowp", "autocast")  # model_new_<extra>.py

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def vendor(root, package="mypkg"):
    """Copies the core, its extras, kernels/ and problem 84's folder (no dist/) into
    root/<package>/ (a package: __init__.py); returns that folder."""
    dest = os.path.join(root, package) if package else root
    os.makedirs(dest, exist_ok=True)
    if package:
        open(os.path.join(dest, "__init__.py"), "w").close()
    for name in CORE_FILES:
        shutil.copy(os.path.join(REPO, name), dest)
    shutil.copytree(os.path.join(REPO, "kernels"), os.path.join(dest, "kernels"))
    shutil.copytree(os.path.join(REPO, FOLDER_84), os.path.join(dest, FOLDER_84),
                    ignore=shutil.ignore_patterns("dist", "__pycache__", "test_*.py"))
    return dest


# Prepended to every case's script: what a case reports about a core module.
PRELUDE = textwrap.dedent('''
    import json, os, sys, importlib, importlib.util
    import torch

    def describe(core):
        """The core's extras: module name, file, and whether it is bound to this core."""
        out = {"name": core.__name__, "file": core.__file__, "ops": core._OP_NAMESPACE, "extras": {}}
        for key in ("sync", "lowp", "autocast"):
            module = core.extra("model_new_" + key)
            out["extras"][key] = None if module is None else {
                "name": module.__name__, "file": module.__file__, "bound": module.engine is core.ENGINE,
                "in_sys_modules": sys.modules.get(module.__name__) is module}
        out["missing"] = {key: core.extra_missing("model_new_" + key) for key in ("sync", "lowp", "autocast")}
        out["lowp_engine_is_bound_lowp"] = core.ENGINE.lowp is core.extra("model_new_lowp")
        return out

    def matches_model(new_cls, ref_cls, args, training=True, dtype=torch.float64):
        """ModelNew against Model on the CPU (float64), outputs and running statistics."""
        torch.manual_seed(0)
        ref = ref_cls(*args).to(dtype)
        torch.manual_seed(0)
        new = new_cls(*args).to(dtype)
        ref.train(training); new.train(training)
        x = torch.randn(16, args[0], dtype=dtype)
        ok = torch.allclose(new(x), ref(x), rtol=1e-9, atol=1e-9)
        return bool(ok and torch.allclose(new.bn.running_mean, ref.bn.running_mean, rtol=1e-9, atol=1e-12))

    def load_by_path(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    RESULT = {}
''')


def run_case(script, cwd, path=(), env=None):
    """Runs PRELUDE + script in a fresh interpreter (cwd, sys.path entries `path`, no
    other entry of this repository; `env`: more environment variables) and returns
    its RESULT, printed as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    env.pop("FUSED_GEMM_BN_KERNEL_DIR", None)
    text = PRELUDE + textwrap.dedent(script) + "\nprint('RESULT ' + json.dumps(RESULT))\n"
    proc = subprocess.run([sys.executable, "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def assert_bound(described, expected_names, folder):
    for key in EXTRAS:
        got = described["extras"][key]
        assert got is not None, (key, described)
        assert got["name"] == expected_names[key], (key, got)
        assert got["file"] == os.path.join(folder, f"model_new_{key}.py"), (key, got)
        assert got["bound"] and got["in_sys_modules"], (key, got)
    assert described["missing"] == {key: None for key in EXTRAS}
    assert described["lowp_engine_is_bound_lowp"]


def test_cpu_vendored_package(tmp_path):
    folder = vendor(str(tmp_path))
    got = run_case(f'''
        import mypkg.model_new as core
        import mypkg.{FOLDER_84}.model_new as m84
        import mypkg.reference as ref33
        ref84 = load_by_path("ref84", os.path.join(os.path.dirname(m84.__file__), "reference.py"))
        RESULT["core"] = describe(core)
        RESULT["84_uses_vendored_core"] = m84.FusedModule is core.FusedModule
        RESULT["repository_core_loaded"] = "model_new" in sys.modules
        RESULT["33"] = matches_model(core.ModelNew, ref33.Model, (12, 10, (10,)))
        RESULT["84"] = matches_model(m84.ModelNew, ref84.Model, (12, 10, 1e-5, 0.1, (1,)))
        RESULT["84_eval"] = matches_model(m84.ModelNew, ref84.Model, (12, 10, 1e-5, 0.1, (1,)), training=False)
        RESULT["lowp_sources"] = sorted(core.extra("model_new_lowp").sources())[:3]
    ''', cwd=str(tmp_path), path=[str(tmp_path)])
    assert_bound(got["core"], {k: f"mypkg.model_new_{k}" for k in EXTRAS}, folder)
    assert got["core"]["file"] == os.path.join(folder, "model_new.py")
    assert got["84_uses_vendored_core"] and not got["repository_core_loaded"]
    assert got["33"] and got["84"] and got["84_eval"]
    assert got["lowp_sources"], "the vendored 16-bit extra finds the vendored kernels/lowp/"


def test_cpu_import_by_path_and_script(tmp_path):
    folder = vendor(str(tmp_path), package=None)
    got = run_case('''
        core = load_by_path("othername", os.path.join(FOLDER, "model_new.py"))
        RESULT["by_path"] = describe(core)
        import runpy
        main = runpy.run_path(os.path.join(FOLDER, "model_new.py"), run_name="__main__")
        RESULT["main_lowp"] = main["extra"]("model_new_lowp").__name__
        RESULT["main_bound"] = all(main["extra"](k).engine is main["ENGINE"] for k in main["_EXTRAS"])
        RESULT["distinct"] = main["extra"]("model_new_lowp") is not core.extra("model_new_lowp")
    '''.replace("FOLDER", repr(folder)), cwd=str(tmp_path))
    assert_bound(got["by_path"], {k: f"othername_{k}" for k in EXTRAS}, folder)
    assert got["main_lowp"] == "__main___lowp" and got["main_bound"] and got["distinct"]

    # python -m and a script beside the files: the core under __main__ / model_new, extras bound.
    with open(os.path.join(folder, "use_it.py"), "w") as f:
        f.write("import model_new, reference, torch\n"
                "m = model_new.ModelNew(8, 6, (6,)).double()\n"
                "assert all(model_new.extra(k).engine is model_new.ENGINE for k in model_new._EXTRAS)\n"
                "print('script ok', model_new.extra('model_new_lowp').__name__, tuple(m(torch.randn(4, 8).double()).shape))\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH="")
    script = subprocess.run([sys.executable, "use_it.py"], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=300)
    assert script.returncode == 0 and "script ok model_new_lowp (4, 6)" in script.stdout, script.stderr[-3000:]
    as_main = subprocess.run([sys.executable, "-m", "model_new"], cwd=folder, env=env, capture_output=True,
                             text=True, timeout=300)
    assert as_main.returncode == 0, as_main.stderr[-3000:]


def test_cpu_two_copies_in_one_process(tmp_path):
    same = vendor(str(tmp_path / "same"))
    other = vendor(str(tmp_path / "other"), package="otherpkg")
    with open(os.path.join(other, "model_new_lowp.py"), "a") as f:
        f.write("\n# a copy whose files differ from the repository's\n")
    got = run_case(f'''
        import model_new as root
        import reference as ref33
        sys.path.insert(0, {str(tmp_path / "same")!r})
        import mypkg.model_new as same
        sys.path.insert(0, {str(tmp_path / "other")!r})
        import otherpkg.model_new as other
        RESULT["root"], RESULT["same"], RESULT["other"] = describe(root), describe(same), describe(other)
        RESULT["separate"] = len({{id(c.extra(k)) for c in (root, same, other) for k in root._EXTRAS}})
        RESULT["models"] = [matches_model(c.ModelNew, ref33.Model, (12, 10, (10,))) for c in (root, same, other)]
        RESULT["has_ops"] = root._OPS is not None
        RESULT["root_identity"] = root._engine_identity()
        RESULT["ops_distinct"] = root._OPS is not other._OPS
    ''', cwd=REPO, path=[REPO])
    assert_bound(got["root"], {k: f"model_new_{k}" for k in EXTRAS}, REPO)
    assert_bound(got["same"], {k: f"mypkg.model_new_{k}" for k in EXTRAS}, same)
    assert_bound(got["other"], {k: f"otherpkg.model_new_{k}" for k in EXTRAS}, other)
    assert got["separate"] == 9, "each copy has its own three extras"
    assert got["models"] == [True, True, True]
    # Identical files: one engine identity, one namespace; different files: their own.
    assert got["same"]["ops"] == got["root"]["ops"] == "fused_gemm_bn_" + got["root_identity"][:16]
    assert got["other"]["ops"].startswith("fused_gemm_bn_") and got["other"]["ops"] != got["root"]["ops"]
    if got["has_ops"]:
        assert got["ops_distinct"]


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="no custom operators (torch < 2.4)")
def test_cpu_compile_cache_of_another_version(tmp_path):
    """torch.compile's caches on disk (FX graphs, AOTAutograd's forward + backward) key
    a graph by its operators' names, not by what their Python does.  Two versions of
    the files, one after the other with one cache folder, as after an upgrade: the
    second one's backward (every gradient doubled, on the operators' path only) must
    run, not the first one's graph from the cache.  The operators' namespace names
    the engine's identity (model_new._engine_identity), so another version's graph
    is another key.  With one namespace for every version this failed (version 2 ran
    version 1's backward); an operator removed in version 2 failed as
    "AttributeError: ... has no attribute ..." instead."""
    versions = [vendor(str(tmp_path / "v1")), vendor(str(tmp_path / "v2"))]
    path = os.path.join(versions[1], "model_new.py")
    with open(path) as f:
        text = f.read()
    anchor = "def _backward_forward_train_saved(ctx, grad_out, *unused):\n"
    assert text.count(anchor) == 1
    with open(path, "w") as f:
        f.write(text.replace(anchor, anchor + "    grad_out = grad_out * 2\n"))
    script = '''
        import copy
        import mypkg.model_new as core
        torch.manual_seed(0)
        model = core.ModelNew(16, 8, (8,)).double()
        compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
        x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
        compiled(x).pow(2).sum().backward()
        grad_compiled = x.grad
        x.grad = None
        core.SWITCHES = core.SWITCHES._replace(eager_ops=True)  # eager calls through the operators
        model(x).pow(2).sum().backward()
        RESULT["ops"] = core._OP_NAMESPACE
        RESULT["ratio"] = (grad_compiled.norm() / x.grad.norm()).item()
        RESULT["close"] = torch.allclose(grad_compiled, x.grad, rtol=1e-9, atol=0)
    '''
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    got = [run_case(script, cwd=folder, path=[os.path.dirname(folder)], env=env) for folder in versions]
    assert got[0]["ops"] != got[1]["ops"]
    for version, result in enumerate(got, 1):
        assert result["close"], f"version {version}: compiled / eager gradient norm {result['ratio']}"


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="no custom operators (torch < 2.4)")
def test_cpu_exported_program_in_another_process(tmp_path):
    """torch.export.save in one process, torch.export.load in another that imported the
    same files: the program's operators resolve there (their namespace,
    fused_gemm_bn_<identity>, is the same in every process of one version of the files)
    and it gives the output it gave."""
    script = '''
        import model_new
        torch.manual_seed(0)
        model = model_new.ModelNew(16, 8, (8,)).double().eval()
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        x = torch.randn(12, 16, dtype=torch.float64)
        if SAVE:
            program = torch.export.export(model, (x,))
            torch.export.save(program, PATH)
            out = model(x)
        else:
            out = torch.export.load(PATH).module()(x)
        RESULT["out"] = out.tolist()
        RESULT["ops"] = model_new._OP_NAMESPACE
    '''
    path = str(tmp_path / "program.pt2")
    got = [run_case(f"SAVE, PATH = {save}, {path!r}\n" + textwrap.dedent(script), cwd=REPO, path=[REPO])
           for save in (True, False)]
    assert got[0]["ops"] == got[1]["ops"]
    assert got[0]["out"] == got[1]["out"]


def test_cpu_missing_extra(tmp_path):
    folder = vendor(str(tmp_path))
    os.remove(os.path.join(folder, "model_new_lowp.py"))
    os.remove(os.path.join(folder, "model_new_sync.py"))
    got = run_case('''
        import warnings
        import mypkg.model_new as core
        RESULT["core"] = describe(core)

        class ReportsCuda(torch.Tensor):
            @property
            def is_cuda(self):
                return True

        x = torch.rand(4, 8).to(torch.float16).as_subclass(ReportsCuda)
        message = ""
        try:
            core.check_input(x, torch.rand(6, 8).to(torch.float16), True)
        except RuntimeError as exc:
            message = str(exc)
        RESULT["message"] = message
        core._distributed_world_size = lambda group=None: 2  # as under torch.distributed with 2 processes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            core.ModelNew(8, 6, (6,)).double()(torch.randn(4, 8).double())
        RESULT["warnings"] = [str(w.message) for w in caught]
    ''', cwd=str(tmp_path), path=[str(tmp_path)])
    core = got["core"]
    assert core["extras"]["lowp"] is None and core["extras"]["sync"] is None
    assert core["extras"]["autocast"] is not None and core["extras"]["autocast"]["bound"]
    lowp_path = os.path.join(folder, "model_new_lowp.py")
    assert core["missing"]["lowp"] == f"{lowp_path} is missing"
    assert f"{lowp_path} is missing" in got["message"] and "self-contained" not in got["message"]
    sync_path = os.path.join(folder, "model_new_sync.py")
    assert any(f"{sync_path} is missing" in w and "self-contained" not in w for w in got["warnings"]), got["warnings"]


@requires_cuda
def test_gpu_vendored_16bit_and_autocast(tmp_path):
    """A vendored copy runs the 16-bit kernels for float16 / bfloat16 modules and
    the fused autocast path (on Hopper), with the bound tests/test_lowp.py and
    tests/test_autocast_fused.py use: err(ModelNew) <= 1.05 err(Model in the same
    precision) + 1e-6, both against Model in float64 on the same parameters."""
    vendor(str(tmp_path))
    got = run_case('''
        import copy
        import mypkg.model_new as core
        import mypkg.reference as ref33
        torch.backends.cuda.matmul.allow_tf32 = False

        def rel_err(t, ref):
            return float((t.double() - ref).norm() / ref.norm())

        RESULT["paths"], RESULT["errors"] = {}, {}
        m, k, n = 256, 512, 384
        for dtype in (torch.float16, torch.bfloat16, "autocast"):
            low = torch.float32 if dtype == "autocast" else dtype
            torch.manual_seed(0)
            ref = ref33.Model(k, n, (n,)).cuda().to(low)
            torch.manual_seed(0)
            new = core.ModelNew(k, n, (n,)).cuda().to(low)
            ref64 = copy.deepcopy(ref).double()
            x = torch.randn(m, k, device="cuda").to(low)
            want = ref64(x.double())
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=dtype == "autocast"):
                RESULT["paths"][str(dtype)] = new.kernel_path(x)
                RESULT["errors"][str(dtype)] = (rel_err(new(x), want), rel_err(ref(x), want))
    ''', cwd=str(tmp_path), path=[str(tmp_path)])
    for dtype in ("torch.float16", "torch.bfloat16"):
        assert got["paths"][dtype].startswith("lowp_"), got["paths"]
    if torch.cuda.get_device_capability() == (9, 0):
        assert got["paths"]["autocast"] == "lowp_sm90_autocast_train", got["paths"]
    for name, (err_new, err_eager) in got["errors"].items():
        print(f"[{name}] err ModelNew {err_new:.3e}, Model {err_eager:.3e}")
        assert err_new <= 1.05 * err_eager + 1e-6, (name, err_new, err_eager)


@requires_cuda
def test_gpu_two_differing_copies_16bit(tmp_path):
    """Two 16-bit extensions in one process: each sets up its own kernels.  A
    launch cache shared between the copies (a function-local static merged across
    libraries) once let the second copy skip its kernel's shared-memory opt-in,
    and its first walking row softmax failed with "invalid argument"."""
    other = vendor(str(tmp_path / "other"), package="otherpkg")
    with open(os.path.join(other, "kernels", "lowp", "bn_16bit.cu"), "a") as f:
        f.write("\n// a copy whose 16-bit sources differ: its own 16-bit extension\n")
    got = run_case(f'''
        import model_new as root
        from level2_84_gemm_batchnorm_scaling_softmax import model_new as root84
        sys.path.insert(0, {str(tmp_path / "other")!r})
        import otherpkg.model_new as other
        from otherpkg.level2_84_gemm_batchnorm_scaling_softmax import model_new as other84
        m, k, n = 512, 64, 8192
        x = torch.rand(m, k, device="cuda").half()
        outs, names = [], []
        for core, problem in ((root, root84), (other, other84)):
            torch.manual_seed(0)
            new = problem.ModelNew(k, n).cuda().half()
            with torch.no_grad():
                outs.append(new(x))
            names.append(core.extra("model_new_lowp").kernels().__name__)
        torch.cuda.synchronize()
        RESULT["distinct_extensions"] = names[0] != names[1]
        RESULT["equal"] = bool(torch.equal(outs[0], outs[1]))
        RESULT["finite"] = bool(torch.isfinite(outs[1]).all())
    ''', cwd=REPO, path=[REPO])
    assert got == {"distinct_extensions": True, "equal": True, "finite": True}, got
