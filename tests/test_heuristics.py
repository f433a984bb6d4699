"""The launch heuristics of kernels/heuristics_{common,sm80,sm90}.cuh, checked on
the CPU: tests/heuristics_driver.cpp includes the headers (they hold no CUDA
runtime calls), is compiled with the host C++ compiler and prints each named
case's decision; the tests assert those decisions by name, on the shapes whose
measurements set each rule (the comments beside the rules and docs/perf.md) and
on shapes either side of each threshold.  Skipped, with the reason, where no
C++ compiler is found ($CXX, g++, c++, clang++)."""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_DIR = os.path.join(REPO, "kernels")
DRIVER = os.path.join(REPO, "tests", "heuristics_driver.cpp")
HEADERS = ["heuristics_common.cuh", "heuristics_sm80.cuh", "heuristics_sm90.cuh"]
H100_SMS = 132  # the driver's SM count (H100 SXM, H200)


def _compiler():
    for name in [os.environ.get("CXX"), "g++", "c++", "clang++"]:
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.skip("no C++ compiler found ($CXX, g++, c++, clang++): the heuristics driver cannot be built")


@pytest.fixture(scope="module")
def decisions(tmp_path_factory):
    """{case name: {key: int}} as the driver prints them."""
    exe = str(tmp_path_factory.mktemp("heuristics") / "heuristics_driver")
    build = subprocess.run([_compiler(), "-std=c++17", "-Wall", "-Werror", "-I", KERNEL_DIR, DRIVER, "-o", exe],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    cases = {}
    for line in out.splitlines():
        name, *fields = line.split()
        assert name not in cases, f"case {name} printed twice"
        cases[name] = {k: int(v) for k, v in (f.split("=") for f in fields)}
    return cases


@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone_without_cuda(header, tmp_path):
    """Each header stands alone in plain C++ (no CUDA headers on the include path)."""
    src = tmp_path / "one.cpp"
    src.write_text(f'#include "{header}"\nint main() {{ return 0; }}\n')
    r = subprocess.run([_compiler(), "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", KERNEL_DIR, str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- sm90: stream_k_plan -----------------------------------------------------

def test_kernelbench_shape_splits_the_remainder_tiles(decisions):
    # 1024 x 8192 x 8192 on 132 SMs: 512 tiles = 3.88 waves; the 512 % 132 = 116
    # remainder tiles are cut along K and run first, the rest in 3 whole waves.
    p = decisions["sk_kernelbench_M1024_N8192_K8192"]
    assert p["sk_tiles"] == 512 % H100_SMS == 116
    assert p["dp_tiles"] == 3 * H100_SMS
    assert p["pieces"] == 2 and p["tails_per_cta"] > 1  # 2 R > SMs: first pieces + tails
    assert p["sk_ctas"] <= H100_SMS


def test_whole_waves_split_nothing(decisions):
    # 8 x 66 = 528 tiles = 4 waves of 132: no part-empty wave, no split.
    p = decisions["sk_whole_waves_M1024_N8448_K8192"]
    assert p["sk_ctas"] == 0 and p["dp_tiles"] == 528


def test_few_tiles_take_split_k(decisions):
    # 64 tiles (2 R <= SMs): each cut into equal pieces, p <= SMs / R = 2.
    p = decisions["sk_split_k_M128_N8192_K8192"]
    assert p["sk_tiles"] == 64 and p["pieces"] == 2 and p["tails_per_cta"] == 1 and p["dp_tiles"] == 0


def test_split_k_keeps_pieces_above_pipeline_start_up(decisions):
    # A piece holds at least 4 k-blocks of 64: 7 k-blocks cannot be split, 8 can.
    assert decisions["sk_split_k_M128_N8192_K448"]["sk_ctas"] == 0
    p = decisions["sk_split_k_M128_N8192_K512"]
    assert p["pieces"] == 2 and p["piece_blocks"] == 4


def test_unknown_sm_count_splits_nothing(decisions):
    assert decisions["sk_no_sms_M1024_N8192_K8192"]["sk_ctas"] == 0


# ---- sm90: persistent_grid_pays ---------------------------------------------

def test_kernelbench_forward_keeps_one_cta_per_unit(decisions):
    # 128 k-blocks: the persistent grid was 5-15% slower (582 -> 613-620 us, perf.md v41).
    assert decisions["persist_kernelbench_forward_K8192"]["persistent"] == 0


def test_backward_grad_w_at_small_batches_is_persistent(decisions):
    # grad W = grad_z^T x reduces over the batch: 256 rows 279 -> 224 us, 1024 rows 645 -> 639 (v40).
    assert decisions["persist_grad_w_batch256_K256"]["persistent"] == 1
    assert decisions["persist_grad_w_batch1024_K1024"]["persistent"] == 1


def test_short_k_forward_is_persistent(decisions):
    # 8192 x 512 x 8192: 463 -> 405 us (v40).
    assert decisions["persist_short_k_forward_K512"]["persistent"] == 1


def test_persistent_threshold_is_32_k_blocks(decisions):
    # 32 k-blocks of 64 pay; 33 and 64 (mixed, v41) do not.
    assert decisions["persist_K2048"]["persistent"] == 1
    assert decisions["persist_K2049"]["persistent"] == 0
    assert decisions["persist_K4096"]["persistent"] == 0


# ---- sm90: lowp_grid_plan ----------------------------------------------------

def test_lowp_big_tile_where_it_fills_half_the_gpu(decisions):
    # 512 x 8192 x 8192: 128 tiles of 256 rows fill 132 SMs' half (0.098 ms, split 128-row plan 0.153).
    assert decisions["lowp_M512_N8192_K8192"]["block_m"] == 256
    # 256 x 8192 x 8192: 64 tiles of 256 rows do not (0.090 ms, 128-row plan 0.058; perf.md v26).
    assert decisions["lowp_M256_N8192_K8192"]["block_m"] == 128


def test_lowp_tile_threshold_is_half_the_sms(decisions):
    # 64 tiles of 256 rows: enough on 128 SMs, not on 129.
    assert decisions["lowp_M256_N8192_K8192_128sms"]["block_m"] == 256
    assert decisions["lowp_M256_N8192_K8192_129sms"]["block_m"] == 128


# ---- sm80: sm80_tile_dims, sm80_split_plan -----------------------------------

def test_sm80_small_tile_up_to_64_rows(decisions):
    # 17-64 rows: the 128-row tile was slower than eager, the 16-row tile faster (perf.md v37).
    assert (decisions["sm80_M64_N8192_K8192"]["block_m"], decisions["sm80_M64_N8192_K8192"]["block_n"]) == (16, 256)
    assert (decisions["sm80_M65_N8192_K8192"]["block_m"], decisions["sm80_M65_N8192_K8192"]["block_n"]) == (128, 128)


def test_sm80_split_fills_idle_sms(decisions):
    # 128 x 8192 x 1024: 8 tiles on 132 SMs; no split 0.636 ms, split 0.159 (v37).
    assert decisions["sm80_M128_N1024_K8192"]["pieces"] > 8
    # 1024 x 8192 x 8192: 512 tiles fill the SMs; the split did not pay (2.495 -> 2.500): none.
    assert decisions["sm80_M1024_N8192_K8192"]["pieces"] == 1


def test_sm80_small_batch_pieces_hold_at_most_512_k(decisions):
    # Below 16 rows the promotion chain's error sets the pieces: at most 512 k each.
    p = decisions["sm80_M15_N8192_K8192"]
    assert p["pieces"] > 1 and p["piece_k"] <= 512
    # 16 rows: only the SM fill counts (32 tiles on 132 SMs: 4 pieces of 2048 k).
    q = decisions["sm80_M16_N8192_K8192"]
    assert q["piece_k"] > 512 and q["pieces"] == H100_SMS // 32


def test_sm80_pieces_capped(decisions):
    assert decisions["sm80_max_pieces_M16_N128_K65536"]["pieces"] == 64


def test_sm80_one_k_slab_is_not_split(decisions):
    assert decisions["sm80_M128_N1024_K32"]["pieces"] == 1


# ---- common: resident_strip_pays ---------------------------------------------

def test_resident_strip_at_the_measured_shapes(decisions):
    # H200 (perf.md v39): 1024 x 8192 57.6 -> 47.7 us; 1024 x 130 30.4 -> 10.4;
    # 128 x 8192 the two-pass kernel (10.8 against 26.3); 640 x 8192 a tie (two-pass kept).
    assert decisions["res_M1024_N8192"]["resident"] == 1
    assert decisions["res_M1024_N130"]["resident"] == 1
    assert decisions["res_M128_N8192"]["resident"] == 0
    assert decisions["res_M640_N8192"]["resident"] == 0


def test_resident_strip_thresholds(decisions):
    assert decisions["res_M768_N8192"]["resident"] == 1
    assert decisions["res_M767_N8192"]["resident"] == 0
    assert decisions["res_M256_N2048"]["resident"] == 1
    assert decisions["res_M255_N2048"]["resident"] == 0
    assert decisions["res_M256_N2049"]["resident"] == 0


def test_resident_strip_limits(decisions):
    # The strip holds at most 1024 rows; offsets are 32-bit (M N < 2^31).
    assert decisions["res_M1025_N130"]["resident"] == 0
    assert decisions["res_M1024_N2097152"]["resident"] == 0
