"""The README against the code (CPU, CI): its length, and its support matrix
against model_new.plan() on simulated GPUs (no kernel runs).

The matrix is the markdown table under the header `| dtype | GPU | mode | route |`:
  dtype  one or more of float32, float64, float16, bfloat16, comma-separated
         ("float32 + autocast" rows are not checked here: the autocast decision
         takes tensors and modules, tests/test_mixed_precision.py covers it)
  GPU    sm_90, sm_90 + FUSED_GEMM_BN_PORTABLE=1, sm_80-89 or CPU
  mode   one or more of train, eval, train + grad, eval + grad
  route  route names in backticks, several joined by " or "
For every checked row, dtype and mode, plan() over a grid of shapes (both
problems) must name exactly the routes of the row: no more (a route the README
does not mention) and no fewer (a route it promises that no shape reaches).
"""
import os
import re

import pytest
import torch

import model_new

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MAX_LINES = 200
HEADER = "| dtype | GPU | mode | route |"

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
MODES = {"train": (True, False), "eval": (False, False), "train + grad": (True, True),
         "eval + grad": (False, True)}

# Simulated GPUs: (capability, SMs, this build's sm_90a kernels run there)
H100 = ((9, 0), 132, True)
A100 = ((8, 0), 108, False)
A10 = ((8, 6), 72, False)
L4 = ((8, 9), 58, False)
TURING = ((7, 5), 40, False)

# GPU cell -> [(device_type, simulated GPU or None, portable)]; every entry must agree with the row
GPUS = {
    "sm_90": [("cuda", H100, False)],
    "sm_90 + FUSED_GEMM_BN_PORTABLE=1": [("cuda", H100, True)],
    "sm_80-89": [("cuda", A100, False), ("cuda", A10, False), ("cuda", L4, False)],
    "sm_80": [("cuda", A100, False)],
    "sm_86-89": [("cuda", A10, False), ("cuda", L4, False)],
    "CPU": [("cpu", None, False)],
}


def facts(gpu):
    """model_new.DeviceFacts of a simulated GPU (None for the CPU); made at call time, so
    an API mismatch fails these tests and not the collection of the whole suite."""
    if gpu is None:
        return None
    capability, num_sms, sm90_gemm = gpu
    return model_new.DeviceFacts(capability=capability, num_sms=num_sms, sm90_gemm=sm90_gemm)

# Shapes: tails, K not a multiple of 4 or 8, tiny and large batches, grids of every fill
M_GRID = (1, 2, 7, 128, 333, 1000, 1024, 4096, 16384)
N_GRID = (1, 7, 513, 1024, 5000, 8192)
K_GRID = (1, 3, 4, 7, 513, 4095, 8192)


def read_readme():
    with open(README, encoding="utf-8") as f:
        return f.read().splitlines()


def parse_matrix(lines):
    """The support matrix's rows as dicts of cell text (dtype, GPU, mode, route)."""
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == HEADER)
    except StopIteration:
        raise AssertionError(f"README has no support matrix (a table with the header {HEADER!r})")
    keys = ("dtype", "GPU", "mode", "route")
    rows = []
    for line in lines[start + 2:]:  # header, |---| separator
        line = line.strip()
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4, f"support matrix row without 4 cells: {line!r}"
        rows.append(dict(zip(keys, cells)))
    assert rows, "support matrix has no rows"
    return rows


def routes_of(cell):
    """The route names of a route cell: backticked names joined by ' or '."""
    names = re.findall(r"`([^`]+)`", cell)
    rest = re.sub(r"`[^`]+`", "", cell).replace(" or ", "").strip()
    assert names and not rest, f"route cell not of the form `a` or `b`: {cell!r}"
    return set(names)


def routes_seen(device_type, gpu, portable, dtype, training, grad):
    """Every Plan.gemm that plan() gives over the shape grid and both problems."""
    device = facts(gpu)
    switches = model_new.SWITCHES._replace(portable=portable)
    seen = set()
    for m in M_GRID:
        for n in N_GRID:
            for k in K_GRID:
                for scale_after_bn in (False, True):
                    call = model_new.Call(device_type, dtype, m, n, k, training, grad, scale_after_bn)
                    seen.add(model_new.plan(call, device, switches).gemm)
    return seen


def check_matrix(rows):
    """Mismatches between the matrix rows and plan(), as readable strings (empty: all agree).
    Also flags a (dtype, GPU, mode) listed twice and cells outside the vocabulary."""
    problems = []
    listed = set()
    for row in rows:
        if "autocast" in row["dtype"]:
            continue
        dtypes = [d.strip() for d in row["dtype"].split(",")]
        modes = [m.strip() for m in row["mode"].split(",")]
        unknown = [d for d in dtypes if d not in DTYPES] + [m for m in modes if m not in MODES]
        if row["GPU"] not in GPUS or unknown:
            problems.append(f"row {row}: unknown GPU, dtype or mode {unknown or row['GPU']!r}")
            continue
        expected = routes_of(row["route"])
        for dtype in dtypes:
            for mode in modes:
                key = (dtype, row["GPU"], mode)
                if key in listed:
                    problems.append(f"{key} listed twice")
                listed.add(key)
                training, grad = MODES[mode]
                for device_type, gpu, portable in GPUS[row["GPU"]]:
                    seen = routes_seen(device_type, gpu, portable, DTYPES[dtype], training, grad)
                    if seen != expected:
                        where = gpu[0] if gpu is not None else device_type
                        problems.append(f"{dtype} on {row['GPU']} ({where}), {mode}: README says "
                                        f"{sorted(expected)}, plan() gives {sorted(seen)}")
    return problems


def test_readme_length():
    lines = read_readme()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}: the rest goes to docs/)"


def test_support_matrix_matches_plan():
    problems = check_matrix(parse_matrix(read_readme()))
    assert not problems, "README support matrix disagrees with model_new.plan():\n" + "\n".join(problems)


def test_support_matrix_covers_every_dtype_gpu_mode():
    """Every dtype on sm_90, sm_80-89 (one row, or rows for sm_80 and sm_86-89) and the CPU,
    in every mode, has a row."""
    listed = set()
    for row in parse_matrix(read_readme()):
        if "autocast" in row["dtype"]:
            continue
        for dtype in row["dtype"].split(","):
            for mode in row["mode"].split(","):
                listed.add((dtype.strip(), row["GPU"], mode.strip()))
    for dtype, gpu, mode in list(listed):  # sm_80 and sm_86-89 together cover sm_80-89
        if gpu == "sm_80" and (dtype, "sm_86-89", mode) in listed:
            listed.add((dtype, "sm_80-89", mode))
    missing = [(d, g, m) for d in DTYPES for g in ("sm_90", "sm_80-89", "CPU") for m in MODES
               if (d, g, m) not in listed]
    assert not missing, f"support matrix has no row for {missing}"


def _replace_route(rows, dtype, gpu, new_route):
    """A copy of rows with the route cell of the first row for (dtype, gpu) replaced."""
    out, done = [], False
    for row in rows:
        if not done and row["GPU"] == gpu and dtype in [d.strip() for d in row["dtype"].split(",")]:
            row = dict(row, route=new_route)
            done = True
        out.append(row)
    assert done, f"no README row for {dtype} on {gpu}"
    return out


@pytest.mark.parametrize("dtype, gpu, wrong", [
    ("float32", "sm_90", "`sm80_3xtf32`"),                        # a wrong route
    ("float32", "sm_80-89", "`sm80_3xtf32` or `sm90_fp16x3`"),    # a route no shape reaches
    ("float16", "sm_90", "`lowp_sm90`"),                          # a route missing (lowp_cublas)
    ("float64", "CPU", "`torch_ops` or `empty`"),                 # batch 0 is not in the grid
], ids=["wrong", "extra", "missing", "cpu-extra"])
def test_support_matrix_check_fails_on_a_wrong_row(dtype, gpu, wrong):
    """Negative control: the same checker on the README's matrix with one row's route altered."""
    rows = _replace_route(parse_matrix(read_readme()), dtype, gpu, wrong)
    assert check_matrix(rows), f"check_matrix accepted {dtype} on {gpu} routed to {wrong}"


def test_batch_of_zero_and_old_gpus():
    """The matrix's notes: a batch of 0 runs no kernel (`empty`); below compute capability 8.0
    CUDA float32 and 16-bit input raise RuntimeError."""
    text = "\n".join(read_readme())
    assert "`empty`" in text and "RuntimeError" in text
    for dtype in DTYPES.values():
        for device_type, gpu in (("cuda", H100), ("cuda", A100), ("cpu", None)):
            call = model_new.Call(device_type, dtype, 0, 64, 64, True, False, False)
            assert model_new.plan(call, facts(gpu), model_new.SWITCHES).gemm == "empty"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        with pytest.raises(RuntimeError, match="compute capability"):
            model_new.plan(model_new.Call("cuda", dtype, 8, 64, 64, True, False, False), facts(TURING),
                           model_new.SWITCHES)
