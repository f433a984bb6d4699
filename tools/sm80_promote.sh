#!/bin/bash
# Issue 40 item 7: the sm80_3xtf32 kernel's running_var on log-normal inputs, A/B over its
# numerics switches (kernels/sm80_gemm_3xtf32_bn.cuh: FUSED_GEMM_BN_SM80_SPAN_K,
# _SMALL_TERMS_FIRST, _TILE_STATS_F64).
#
#   bash tools/sm80_promote.sh              # on a 1-GPU Hopper machine, repo root as cwd, $OUT set
#   bash tools/sm80_promote.sh --dry-run    # any machine: prepares the variant kernel folders, prints
#                                            # each one's defines, extension name and commands; no GPU
#   bash tools/sm80_promote.sh --ptxas      # any machine with nvcc: ptxas registers / spills per variant
#   bash tools/sm80_promote.sh --table      # the summary table again, from the files in $OUT
#
# How a variant gets its -D flags: model_new builds the float32 extension at import from
# $FUSED_GEMM_BN_KERNEL_DIR, with flags of its own choosing.  So each variant is a copy of
# kernels/ in /tmp/kern_<variant> whose sm80_gemm_3xtf32_bn.cuh starts with the variant's
# #defines (the header reads them through #ifndef, exactly as it would read -D flags): the
# sources differ, so model_new._extension_name differs, and every variant also builds in its
# own TORCH_EXTENSIONS_DIR=/tmp/ext_<variant>.  One import per variant builds once; the
# running-statistics and bench processes of that variant then load that build.
#
# Steps: all builds in the background at once (~60-90 s each, one nvcc TU each); each
# variant's tools/running_stats_seeds.py (10 seeds, problems 33 and 84, 64x512x256 and
# 256x1024x512, log-normal and uniform; eager in the same run) as soon as its build is
# done; then, with the CPU quiet, bench.py at the KernelBench shape (1024x8192x8192, 33,
# train and eval) per variant, and the default once more at the end (drift).  All with
# FUSED_GEMM_BN_PORTABLE=1.  Outputs in $OUT: build_*.log, seeds_*.{txt,json},
# bench_*.{log,json}, summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 FUSED_GEMM_BN_PORTABLE=1
MODE=${1:-run}
case "$MODE" in run|--dry-run|--ptxas|--table) ;; *) echo "usage: $0 [--dry-run|--ptxas|--table]" >&2; exit 2;; esac
OUT=${OUT:-/tmp/sm80_promote_out}
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# name|defines (NAME=VALUE, space-separated; empty: the default build)
VARIANTS=(
  "default|"
  "span32|FUSED_GEMM_BN_SM80_SPAN_K=32 FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST=0 FUSED_GEMM_BN_SM80_TILE_STATS_F64=0"
  "span8|FUSED_GEMM_BN_SM80_SPAN_K=8 FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST=0"
  "span16|FUSED_GEMM_BN_SM80_SPAN_K=16 FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST=0 FUSED_GEMM_BN_SM80_TILE_STATS_F64=0"
  "span64|FUSED_GEMM_BN_SM80_SPAN_K=64 FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST=0"
)
HEADER=sm80_gemm_3xtf32_bn.cuh


prepare() {  # prepare NAME "DEFINES": /tmp/kern_NAME with the defines at the top of the header
  local name=$1 defs=$2 dir=/tmp/kern_$1 d
  rm -rf "$dir" && cp -r kernels "$dir" || return 1
  if [ -n "$defs" ]; then
    { echo "// variant $name (tools/sm80_promote.sh)"
      for d in $defs; do echo "#define ${d%%=*} ${d#*=}"; done
      cat "kernels/$HEADER"; } > "$dir/$HEADER" || return 1
  fi
}

for v in "${VARIANTS[@]}"; do prepare "${v%%|*}" "${v#*|}" || { echo "prepare ${v%%|*} failed" >&2; exit 1; }; done

if [ "$MODE" = "--dry-run" ]; then
  for v in "${VARIANTS[@]}"; do
    name=${v%%|*}
    echo "== $name: defines [${v#*|}]"
    head -4 /tmp/kern_$name/$HEADER | grep -E "^#define FUSED_GEMM_BN_SM80_" | sed 's/^/   /'
    FUSED_GEMM_BN_KERNEL_DIR=/tmp/kern_$name "$PY" -c "
import model_new as m
s = m._kernel_sources()
print('   sources', len(s), 'files from', m._kernel_dir())
print('   extension', m._extension_name(s, ['-O3', '-gencode=arch=compute_90a,code=sm_90a']))"
    echo "   build: FUSED_GEMM_BN_KERNEL_DIR=/tmp/kern_$name TORCH_EXTENSIONS_DIR=/tmp/ext_$name $PY -c 'import model_new'"
    echo "   seeds: ... $PY tools/running_stats_seeds.py --seeds 10 --json $OUT/seeds_$name.json"
    echo "   bench: ... $PY bench.py --model 33 --mode both --no-compile --json $OUT/bench_$name.json"
  done
  exit 0
fi

if [ "$MODE" = "--ptxas" ]; then
  std=$("$PY" tools/check_boundary.py --std nvcc 2>/dev/null || echo c++17)
  for v in "${VARIANTS[@]}"; do
    name=${v%%|*}
    for arch in 80 90a; do
      log=$OUT/ptxas_${name}_$arch.log
      if ! nvcc -c "-std=$std" -O3 -Xptxas -v -I /tmp/kern_$name -gencode=arch=compute_$arch,code=sm_$arch \
           -o /tmp/kern_$name/gemm_$arch.o /tmp/kern_$name/sm80_gemm_3xtf32_bn.cu > "$log" 2>&1; then
        echo "$name sm_$arch: compile failed ($log)"; continue
      fi
      regs=$(grep -o 'Used [0-9]* registers' "$log" | awk '{print $2}' | sort -n | uniq | tr '\n' ' ')
      spill=$(grep -oE '[0-9]+ bytes spill (stores|loads)' "$log" | awk '{s += $1} END {print s + 0}')
      printf '%-9s sm_%-4s registers: %s spill bytes (all entries): %s\n' "$name" "$arch" "$regs" "$spill"
    done
  done
  exit 0
fi

if [ "$MODE" = run ]; then
nvidia-smi -L
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

# 1. builds, all at once in the background
rm -f "$OUT"/build_*.rc
for v in "${VARIANTS[@]}"; do
  name=${v%%|*}
  ( FUSED_GEMM_BN_KERNEL_DIR=/tmp/kern_$name TORCH_EXTENSIONS_DIR=/tmp/ext_$name MAX_JOBS=2 \
      timeout 300 "$PY" -c "import model_new; print('built', model_new._ext.__name__)" > "$OUT/build_$name.log" 2>&1
    echo $? > "$OUT/build_$name.rc" ) &
done

# 2. running statistics per variant, each as soon as its build is done, up to 3 processes on
#    the GPU at once (accuracy does not depend on timing)
seed_pids=()
for v in "${VARIANTS[@]}"; do
  name=${v%%|*}
  while [ ! -f "$OUT/build_$name.rc" ]; do sleep 2; done
  echo "build $name: rc $(cat "$OUT/build_$name.rc") at $(elapsed) s: $(tail -1 "$OUT/build_$name.log")"
  [ "$(cat "$OUT/build_$name.rc")" = 0 ] || { tail -5 "$OUT/build_$name.log"; continue; }
  if [ ${#seed_pids[@]} -ge 3 ]; then wait "${seed_pids[0]}"; seed_pids=("${seed_pids[@]:1}"); fi  # 3 at a time
  ( FUSED_GEMM_BN_KERNEL_DIR=/tmp/kern_$name TORCH_EXTENSIONS_DIR=/tmp/ext_$name \
      timeout 240 "$PY" tools/running_stats_seeds.py --seeds 10 --json "$OUT/seeds_$name.json" \
      > "$OUT/seeds_$name.txt" 2>&1; echo "seeds $name: rc $? at $(elapsed) s" ) &
  seed_pids+=($!)
done
for p in ${seed_pids[@]+"${seed_pids[@]}"}; do wait "$p"; done
echo "running statistics done at $(elapsed) s"

# 3. bench at the KernelBench shape, one variant at a time, default first and last
for name in $(for v in "${VARIANTS[@]}"; do echo "${v%%|*}"; done) default2; do
  src=$name; [ "$name" = default2 ] && src=default
  [ "$(cat "$OUT/build_$src.rc" 2>/dev/null)" = 0 ] || continue
  if [ "$(elapsed)" -gt 450 ]; then echo "bench $name skipped: $(elapsed) s elapsed"; continue; fi
  FUSED_GEMM_BN_KERNEL_DIR=/tmp/kern_$src TORCH_EXTENSIONS_DIR=/tmp/ext_$src \
    timeout 75 "$PY" bench.py --model 33 --mode both --iters 50 --warmup 10 --no-compile \
    --json "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
  echo "bench $name: rc $? at $(elapsed) s"
done
fi  # MODE = run; --table only prints the table below from $OUT

# 4. the table
"$PY" - "$OUT" "${VARIANTS[@]}" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out, variants = sys.argv[1], [v.split("|") for v in sys.argv[2:]]
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
cases = [(p, s, f) for p in ("33", "84") for s in ((64, 512, 256), (256, 1024, 512)) for f in ("lognormal", "uniform")]
short = {"lognormal": "LN", "uniform": "U"}
head = " ".join(f"{p}:{s[0]}{short[f]:>2}" for p, s, f in cases)
print("running_var / running_mean after 5 calls: ModelNew's mean error over 10 seeds / eager's (1x = eager)")
print(f"{'variant':9s} {'stat':4s} {head}")
eager = None
for name, defs in variants:
    d = load(os.path.join(out, f"seeds_{name}.json"))
    if d is None:
        print(f"{name:9s} (no result)")
        continue
    by = {(c["problem"], tuple(c["shape"]), c["family"]): c for c in d["cases"]}
    paths = sorted({c["path"] for c in d["cases"]})
    for key, label in (("rv", "rv"), ("rm", "rm")):
        vals = " ".join(f"{by[c][key]['ratio_of_means']:7.2f}" if c in by else "      -" for c in cases)
        print(f"{name:9s} {label:4s} {vals}")
    bias = " ".join(f"{by[c]['rv_bias']['new']:+7.1e}" if c in by else "      -" for c in cases)
    print(f"{name:9s} {'bias':4s} {bias}   (running_var / float64's - 1, mean over features and seeds; path {', '.join(paths)})")
    if eager is None:
        eager = by
if eager:
    print(f"{'eager':9s} {'rv':4s} " + " ".join(f"{eager[c]['rv']['eager_mean']:7.1e}" if c in eager else "      -" for c in cases))
    print(f"{'eager':9s} {'rm':4s} " + " ".join(f"{eager[c]['rm']['eager_mean']:7.1e}" if c in eager else "      -" for c in cases))
    print(f"{'eager':9s} {'bias':4s} " + " ".join(f"{eager[c]['rv_bias']['eager']:+7.1e}" if c in eager else "      -" for c in cases))
print()
print("bench.py --model 33, 1024x8192x8192: ModelNew's median ms, change against the first default run, "
      "and against eager in the same run; ModelNew's rel. error vs float64")
base, device = {}, "?"
for name in [n for n, _ in variants] + ["default2"]:
    d = load(os.path.join(out, f"bench_{name}.json"))
    if d is None:
        continue
    device = d["env"]["device"]
    line = f"{name:9s}"
    for mode in ("train", "eval"):
        rows = {r["side"]: r for r in d["rows"] if r["mode"] == mode}
        if "ModelNew" not in rows:
            continue
        ms = rows["ModelNew"]["median_ms"]
        base.setdefault(mode, ms)
        path = next((c.get("kernel_path") for c in d["checks"] if c.get("mode") == mode), "?")
        eager_ms = rows["eager"]["median_ms"]
        line += (f" | {mode} {ms:6.3f} ms {(ms / base[mode] - 1) * 100:+5.1f}% ({ms / eager_ms:.3f} of eager's "
                 f"{eager_ms:.3f}) err {rows['ModelNew']['rel_err_vs_fp64']:.1e} [{path}]")
    print(line)
print(f"device: {device}")
PY
echo "total $(elapsed) s"
