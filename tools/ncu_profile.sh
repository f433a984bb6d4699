#!/bin/bash
# Issue 39 item 1: where the fp16x3 forward's time goes, per kernel, against the floor's cuBLAS
# kernel, with Nsight Compute, on a 1-GPU H100 / H200 (repo root as cwd, $OUT set, root).
#
#   bash tools/ncu_profile.sh              # profile; about 4-6 min with the float32 extension build
#   bash tools/ncu_profile.sh --dry-run    # any machine: the settings, the ncu command lines, no GPU
#   bash tools/ncu_profile.sh --post [DIR] # the tables again from DIR's <run>.csv (default /tmp/ncu_profile)
#
# Runs (NCU_PROFILE_RUNS, "M,K,N:problem:mode" each; M = batch, K = in_features, N = out_features):
# 1024x8192x8192 and 16384x4096x4096 problem 33 train, then 1024x8192x8192 eval while the
# time budget (NCU_PROFILE_BUDGET_S, 520 s from the start) allows.  Each run is one ncu process
# over tools/ncu_profile_driver.py, which warms up outside the profiled range and then, inside
# one cudaProfilerStart/Stop range (ncu --profile-from-start off), runs ModelNew's forward
# once (torch.no_grad: prepass sm90_prepass_fp16x3_kernel, GEMM sm90_gemm_fp16x3_bn_kernel,
# bn_apply_kernel), a marker kernel (torch.cuda._sleep: aten's spin_kernel), and ONE floor
# product (torch.mm(a16, b16.t(), out_dtype=float32) over K padded to a multiple of 8; the
# floor is three of them).  So every kernel is profiled exactly once, after warm-up; the
# marker splits ModelNew's kernels from the floor's.  NCU_PROFILE_KERNELS="regex:..." adds an
# ncu --kernel-name filter (default: none, every kernel in the range; keep spin_kernel in it).
# ncu flushes the caches before every replay pass (--cache-control all, as bench.py flushes
# L2); clocks are left alone (--clock-control none, NCU_PROFILE_CLOCK=base to lock them), so the
# times compare with bench.py's.  ncu times each kernel alone: ModelNew's sum has no launch
# gaps or overlap.
#
# Metrics: SpeedOfLight, LaunchStats, Occupancy, WarpStateStats (stall reasons per issued
# instruction), SchedulerStats, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis sections
# (NCU_PROFILE_SOURCE=1 adds SourceCounters: sampled stalls per instruction, in the report only),
# plus the METRICS below, each kept only where `ncu --query-metrics` knows its base name
# on this GPU (the Hopper wgmma tensor-pipe counter's name is not certain); if ncu still
# fails, the run is retried with the sections only.
#
# Outputs in $OUT (at most 6 files): summary.txt (per run: one table, kernel | time us |
# tensor pipe % | SM % | top 3 stalls | L2 hit % | DRAM MB | occupancy | registers | shared
# memory, and ModelNew's sum over three floor products), summary.json (the same and every
# stall reason), kineto.txt (each side's kernels under torch.profiler, no ncu: a cross-check
# of names and times), log.txt (commands, ncu and driver output), ncu_raw_csv.tar.gz (ncu
# --csv --page raw --print-units base per run), ncu_reports.tar.gz (the .ncu-rep files, if
# under 15 MiB).
set -uo pipefail
MODE=${1:-run}
case "$MODE" in run|--dry-run|--post) ;; *) echo "usage: $0 [--dry-run|--post [DIR]]" >&2; exit 2;; esac
OUT=${OUT:-/tmp/ncu_profile_out}
WORK=${NCU_PROFILE_WORK:-/tmp/ncu_profile}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext}
PY=$(command -v python3 || command -v python)
RUNS=(${NCU_PROFILE_RUNS:-1024,8192,8192:33:train 16384,4096,4096:33:train 1024,8192,8192:33:eval})
BUDGET_S=${NCU_PROFILE_BUDGET_S:-520}
CLOCK=${NCU_PROFILE_CLOCK:-none}
LOG="$OUT/log.txt"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
log() { echo "$*" | tee -a "$LOG"; }

SECTIONS=(SpeedOfLight LaunchStats Occupancy WarpStateStats SchedulerStats ComputeWorkloadAnalysis
          MemoryWorkloadAnalysis)
[ "${NCU_PROFILE_SOURCE:-0}" = 1 ] && SECTIONS+=(SourceCounters)
METRICS=(
  gpu__time_duration.sum
  sm__cycles_elapsed.avg.per_second
  sm__throughput.avg.pct_of_peak_sustained_elapsed
  sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active
  smsp__issue_active.avg.pct_of_peak_sustained_active
  smsp__warps_eligible.avg.per_cycle_active
  lts__t_sector_hit_rate.pct
  lts__t_bytes.sum
  dram__bytes_read.sum
  dram__bytes_write.sum
  dram__throughput.avg.pct_of_peak_sustained_elapsed
  sm__warps_active.avg.pct_of_peak_sustained_active
  launch__registers_per_thread
  launch__shared_mem_per_block_dynamic
  launch__shared_mem_per_block_static
  launch__grid_size
  launch__block_size
)

# The post-processor: `$PY -c "$POST" filter QUERY_FILE METRIC...` prints the metrics ncu
# knows; `$PY -c "$POST" tables OUT CSV...` writes summary.txt / summary.json.
read -r -d '' POST <<'PYEOF'
import csv, json, os, re, sys

MODELNEW = re.compile(r"fp16x3|bn_apply|bn_fold|bn_softmax|softmax_rows|prepass|centring|3xtf32")
MARKER = "spin_kernel"
STALL = [(re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$"), "cycles per issue"),
         (re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$"), "samples")]
SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,       # -> us
         "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "Tbyte": 1e6,  # -> MB
         "KB": 1e-3, "MB": 1.0, "GB": 1e3}


def number(text):
    text = (text or "").strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def filter_metrics(query_file, metrics):
    known = set()
    with open(query_file, errors="replace") as f:
        for line in f:
            m = re.match(r"\s*([a-z0-9]+__[A-Za-z0-9_]+)", line)
            if m:
                known.add(m.group(1))
    keep = []
    for name in metrics:
        base = name.split(".")[0]
        # launch__ and the duration are not hardware counters: not always in the list
        if base in known or (len(known) < 50 and "gmma" not in base) or base.startswith("launch__") \
                or base == "gpu__time_duration":
            keep.append(name)
        else:
            print(f"skipped (unknown to this ncu / GPU): {name}", file=sys.stderr)
    print(",".join(keep))


def read_raw(path):
    """(rows as dicts of (value, unit)) from ncu --csv --page raw."""
    with open(path, newline="", errors="replace") as f:
        table = [r for r in csv.reader(f)]
    head = next((i for i, r in enumerate(table) if "Kernel Name" in r and "ID" in r), None)
    if head is None:
        return []
    names = table[head]
    body = table[head + 1:]
    units = [""] * len(names)
    if body and body[0] and not (body[0][names.index("ID")] or "").strip():
        units, body = body[0], body[1:]
    rows = []
    for r in body:
        if len(r) != len(names):
            continue
        rows.append({n: (v, units[i] if i < len(units) else "") for i, (n, v) in enumerate(zip(names, r))})
    return rows


def value(row, name, to=None):
    if name not in row:
        return None
    v, unit = row[name]
    x = number(v)
    if x is None:
        return None
    if to is not None:
        x *= SCALE.get(unit.strip(), 1.0)
    return x


def clock_ghz(row):
    """sm__cycles_elapsed.avg.per_second in GHz, whatever unit ncu printed."""
    name = "sm__cycles_elapsed.avg.per_second"
    x = value(row, name)
    if x is None:
        return None
    unit = row[name][1].lower()
    for suffix, scale in (("nsecond", 1.0), ("usecond", 1e-3), ("msecond", 1e-6), ("ghz", 1.0), ("mhz", 1e-3),
                          ("khz", 1e-6)):
        if unit.endswith(suffix):
            return x * scale
    return x / 1e9  # cycle/second, hz


def pct_of(row, base):
    """base's % of peak: .avg.pct_of_peak_sustained_active where collected, else any other
    pct_of_peak suffix of it (the sections' own choice)."""
    preferred = f"{base}.avg.pct_of_peak_sustained_active"
    if value(row, preferred) is not None:
        return value(row, preferred)
    for col in sorted(row):
        if col.startswith(base + ".") and "pct_of_peak" in col and value(row, col) is not None:
            return value(row, col)
    return None


def short(name):
    name = re.sub(r"^void ", "", name)
    name = name.split("(")[0] if not name.startswith("(") else name
    return name if len(name) <= 48 else name[:45] + "..."


def kernel_facts(row):
    stalls, stall_unit = {}, None
    for pattern, unit in STALL:  # the first family (cycles per issued instruction) where present
        for col in row:
            m = pattern.match(col)
            if m and not m.group(1).endswith("not_issued") and m.group(1) != "selected":
                x = value(row, col)
                if x is not None:
                    stalls[m.group(1)] = x
        if stalls:
            stall_unit = unit
            break
    tensor = {k: pct_of(row, f"sm__{k}") for k in ("pipe_tensor_op_gmma_cycles_active",
                                                   "pipe_tensor_op_hmma_cycles_active",
                                                   "inst_executed_pipe_tensor_op_gmma")}
    smem = [value(row, f"launch__shared_mem_per_block_{k}") for k in ("dynamic", "static")]
    return {
        "kernel": row.get("Kernel Name", ("?", ""))[0],
        "id": value(row, "ID"),
        "time_us": value(row, "gpu__time_duration.sum", "us"),
        "sm_clock_ghz": clock_ghz(row),
        "tensor_gmma_pct": tensor["pipe_tensor_op_gmma_cycles_active"],
        "tensor_hmma_pct": tensor["pipe_tensor_op_hmma_cycles_active"],
        "tensor_gmma_inst_pct": tensor["inst_executed_pipe_tensor_op_gmma"],
        "sm_throughput_pct": value(row, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
        "issue_active_pct": value(row, "smsp__issue_active.avg.pct_of_peak_sustained_active"),
        "eligible_warps": value(row, "smsp__warps_eligible.avg.per_cycle_active"),
        "l2_hit_pct": value(row, "lts__t_sector_hit_rate.pct"),
        "l2_mb": value(row, "lts__t_bytes.sum", "MB"),
        "dram_read_mb": value(row, "dram__bytes_read.sum", "MB"),
        "dram_write_mb": value(row, "dram__bytes_write.sum", "MB"),
        "dram_pct": value(row, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        "occupancy_pct": value(row, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        "registers": value(row, "launch__registers_per_thread"),
        "smem_kib": (sum(s for s in smem if s is not None) / 1024) if any(s is not None for s in smem) else None,
        "grid": value(row, "launch__grid_size"),
        "block": value(row, "launch__block_size"),
        "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1])),
        "stall_unit": stall_unit,
        # every tensor-pipe figure ncu gave (names differ between ncu versions and GPUs)
        "tensor_columns": {c: value(row, c) for c in row if "tensor" in c and value(row, c) is not None},
    }


def sides(rows):
    """Each kernel's side: before the marker ModelNew's, after it the floor's."""
    names = [r.get("Kernel Name", ("", ""))[0] for r in rows]
    marker = next((i for i, n in enumerate(names) if MARKER in n), None)
    out = []
    for i, n in enumerate(names):
        if marker is not None:
            if i != marker:
                out.append(("ModelNew" if i < marker else "floor", rows[i]))
        else:
            out.append(("ModelNew" if MODELNEW.search(n) else "floor", rows[i]))
    return out, marker is not None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(tag, csv_path):
    rows = read_raw(csv_path)
    attributed, by_marker = sides(rows)
    kernels = [dict(kernel_facts(r), side=s) for s, r in attributed]
    lines = [f"== {tag}  ({len(kernels)} kernels; sides split by "
             f"{'the spin_kernel marker' if by_marker else 'kernel names (no marker found)'})"]
    head = (f"{'side':<9}{'kernel':<49}{'time us':>9}{'tensor % g/h':>14}{'SM %':>6}{'issue %':>8}"
            f"  {'top 3 stalls (cycles per issued instr)':<52}{'L2 hit %':>9}{'DRAM rd/wr MB':>15}{'occ %':>7}"
            f"{'regs':>6}{'smem KiB':>9}")
    lines.append(head)
    for k in kernels:
        if k["stall_unit"] == "samples":  # sampled stalls: each reason's share of the samples
            whole = sum(k["stalls"].values()) or 1.0
            top = ", ".join(f"{n} {100 * v / whole:.0f}%" for n, v in list(k["stalls"].items())[:3])
        else:
            top = ", ".join(f"{n} {v:.2f}" for n, v in list(k["stalls"].items())[:3]) or "-"
        dram = (f"{fmt(k['dram_read_mb'], '.1f')}/{fmt(k['dram_write_mb'], '.1f')}")
        tensor = f"{fmt(k['tensor_gmma_pct'], '.1f')}/{fmt(k['tensor_hmma_pct'], '.1f')}"
        lines.append(f"{k['side']:<9}{short(k['kernel']):<49}{fmt(k['time_us'], '.1f'):>9}{tensor:>14}"
                     f"{fmt(k['sm_throughput_pct'], '.0f'):>6}{fmt(k['issue_active_pct'], '.0f'):>8}  {top[:51]:<52}"
                     f"{fmt(k['l2_hit_pct'], '.1f'):>9}{dram:>15}{fmt(k['occupancy_pct'], '.1f'):>7}"
                     f"{fmt(k['registers'], '.0f'):>6}{fmt(k['smem_kib'], '.1f'):>9}")
    total = {s: sum(k["time_us"] or 0 for k in kernels if k["side"] == s) for s in ("ModelNew", "floor")}
    summary = {"ModelNew_us": total["ModelNew"], "floor_one_product_us": total["floor"]}
    if total["floor"]:
        ratio = total["ModelNew"] / (3 * total["floor"])
        summary["ModelNew_over_three_products"] = ratio
        lines.append(f"ModelNew {total['ModelNew']:.1f} us (sum of its kernels) / floor 3 x {total['floor']:.1f} us "
                     f"= {ratio:.3f}")
    clocks = sorted({round(k["sm_clock_ghz"], 2) for k in kernels if k["sm_clock_ghz"]})
    if clocks:
        lines.append(f"SM clock under ncu: {', '.join(f'{c:g}' for c in clocks)} GHz")
    return lines, {"run": tag, "kernels": kernels, "by_marker": by_marker, **summary}


def tables(out_dir, paths):
    lines, data = [], []
    for path in paths:
        tag = os.path.splitext(os.path.basename(path))[0]
        try:
            run_lines, run_data = table(tag, path)
        except Exception as e:  # one bad file must not lose the others
            run_lines, run_data = [f"== {tag}: could not read {path}: {type(e).__name__}: {e}"], {"run": tag}
        lines += run_lines + [""]
        data.append(run_data)
    legend = ("tensor % g/h: sm__pipe_tensor_op_gmma_cycles_active / _hmma_cycles_active, % of peak while active "
              "(- = not collected); SM %: sm__throughput; issue %: smsp__issue_active; stalls: WarpStateStats's "
              "smsp__average_warps_issue_stalled_*_per_issue_active; DRAM: dram__bytes_read / _write; occ %: "
              "achieved occupancy (sm__warps_active); floor: ONE cuBLAS product (bench.py's floor is three)")
    text = "\n".join(lines + [legend]) + "\n"
    with open(os.path.join(out_dir, "summary.txt"), "a") as f:
        f.write(text)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(text)


if __name__ == "__main__":
    if sys.argv[1] == "filter":
        filter_metrics(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "tables":
        tables(sys.argv[2], sys.argv[3:])
PYEOF

if [ "$MODE" = --post ]; then
  DIR=${2:-$WORK}
  : > "$OUT/summary.txt"
  "$PY" -c "$POST" tables "$OUT" "$DIR"/*.csv
  exit $?
fi

find_ncu() {
  local c
  c=$(command -v ncu) && { echo "$c"; return; }
  for c in /usr/local/cuda/bin/ncu $(ls -d /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V -r); do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  return 1
}
NCU=$(find_ncu) || NCU=""
SECTION_ARGS=()
for s in "${SECTIONS[@]}"; do SECTION_ARGS+=(--section "$s"); done
KFILTER=()
[ -n "${NCU_PROFILE_KERNELS:-}" ] && KFILTER=(--kernel-name "$NCU_PROFILE_KERNELS")

ncu_cmd() {  # ncu_cmd TAG SHAPE MODEL MODE METRIC_LIST: the command line, one word per line
  local tag=$1 shape=$2 model=$3 mode=$4 metrics=$5
  local args=("${NCU:-ncu}" --profile-from-start off --target-processes all --replay-mode kernel
              --cache-control all --clock-control "$CLOCK" --launch-count 16 "${KFILTER[@]}" "${SECTION_ARGS[@]}")
  [ -n "$metrics" ] && args+=(--metrics "$metrics")
  args+=(--export "$WORK/$tag" --force-overwrite "$PY" tools/ncu_profile_driver.py --shape "$shape" --model "$model"
         --mode "$mode")
  printf '%s\n' "${args[@]}"
}

: > "$LOG"
: > "$OUT/summary.txt"
log "ncu_profile: runs ${RUNS[*]}; clock-control $CLOCK; budget ${BUDGET_S} s; ncu ${NCU:-NOT FOUND}"
if [ "$MODE" = --dry-run ]; then
  ALL=$(IFS=,; echo "${METRICS[*]}")
  for run in "${RUNS[@]}"; do
    IFS=: read -r shape model mode <<< "$run"
    tag="${shape//,/x}_${model}_${mode}"
    log "would run: $(ncu_cmd "$tag" "$shape" "$model" "$mode" "$ALL" | tr '\n' ' ')"
    "$PY" tools/ncu_profile_driver.py --dry-run --shape "$shape" --model "$model" --mode "$mode" | tee -a "$LOG"
  done
  log "would run: $PY tools/ncu_profile_driver.py --kineto ${RUNS[*]}"
  log "then: ncu --import WORK/TAG.ncu-rep --csv --page raw --print-units base > WORK/TAG.csv; tables"
  exit 0
fi

if [ -z "$NCU" ]; then
  log "ncu not found (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute): nothing profiled"
  exit 3
fi
nvidia-smi -L 2>&1 | tee -a "$LOG"
"$NCU" --version 2>&1 | tail -1 | tee -a "$LOG"
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'python', sys.version.split()[0])" 2>&1 | tee -a "$LOG"
rm -f "$WORK"/*.csv "$WORK"/*.ncu-rep

# The float32 extension (and problem 84's module if a run needs it), outside ncu.
"$PY" -c "import model_new; print('built the float32 extension')" >> "$LOG" 2>&1 || { log "build failed"; tail -30 "$LOG"; exit 1; }
case "${RUNS[*]}" in *:84:*) "$PY" -c "import level2_84_gemm_batchnorm_scaling_softmax.model_new" >> "$LOG" 2>&1;; esac
log "build: $(elapsed) s"

# Section identifiers and metric names this ncu knows on this GPU.
"$NCU" --list-sections > "$WORK/sections.txt" 2>&1
if grep -qw SpeedOfLight "$WORK/sections.txt"; then
  SECTION_ARGS=()
  for s in "${SECTIONS[@]}"; do
    if grep -qw "$s" "$WORK/sections.txt"; then SECTION_ARGS+=(--section "$s"); else log "section $s: unknown, skipped"; fi
  done
fi
"$NCU" --query-metrics > "$WORK/query.txt" 2>&1
METRIC_LIST=$("$PY" -c "$POST" filter "$WORK/query.txt" "${METRICS[@]}" 2>> "$LOG")
log "metrics: $METRIC_LIST ($(grep -c __ "$WORK/query.txt") names in --query-metrics)"

# Names and times without ncu, as a cross-check (torch.profiler; a separate process: CUPTI).
timeout 120 "$PY" tools/ncu_profile_driver.py --kineto "${RUNS[@]}" > "$OUT/kineto.txt" 2>&1
log "kineto: rc $? at $(elapsed) s"

for run in "${RUNS[@]}"; do
  IFS=: read -r shape model mode <<< "$run"
  tag="${shape//,/x}_${model}_${mode}"
  left=$(( BUDGET_S - $(elapsed) ))
  if [ "$left" -lt 60 ]; then log "== $tag: skipped, $left s of the budget left"; continue; fi
  limit=$(( left < 200 ? left : 200 ))
  for attempt in metrics sections; do
    metrics=$([ "$attempt" = metrics ] && echo "$METRIC_LIST")
    mapfile -t cmd < <(ncu_cmd "$tag" "$shape" "$model" "$mode" "$metrics")
    log "== $tag ($attempt, limit $limit s): ${cmd[*]}"
    timeout "$limit" "${cmd[@]}" > "$WORK/$tag.ncu.log" 2>&1
    rc=$?
    [ "$rc" = 124 ] && log "   timed out after $limit s"
    grep -vE "^==PROF== (Profiling|Connected|Disconnected)" "$WORK/$tag.ncu.log" | tail -40 >> "$LOG"
    log "   rc $rc at $(elapsed) s; kernels profiled: $(grep -c '^==PROF== Profiling' "$WORK/$tag.ncu.log")"
    grep -q "ERR_NVGPUCTRPERM" "$WORK/$tag.ncu.log" && log "   no permission for GPU performance counters (needs root)"
    [ -s "$WORK/$tag.ncu-rep" ] || [ "$rc" = 124 ] && break
    limit=$(( BUDGET_S - $(elapsed) )); [ "$limit" -lt 60 ] && break
    [ "$limit" -gt 200 ] && limit=200
  done
  if [ -s "$WORK/$tag.ncu-rep" ]; then
    "$NCU" --import "$WORK/$tag.ncu-rep" --csv --page raw --print-units base > "$WORK/$tag.csv" 2>> "$LOG" \
      || "$NCU" --import "$WORK/$tag.ncu-rep" --csv --page raw > "$WORK/$tag.csv" 2>> "$LOG"
    log "   raw CSV: $(wc -c < "$WORK/$tag.csv") bytes"
  fi
done

csvs=("$WORK"/*.csv)
if [ -e "${csvs[0]}" ]; then
  "$PY" -c "$POST" tables "$OUT" "${csvs[@]}" >> /dev/null 2>> "$LOG"
  (cd "$WORK" && tar czf "$OUT/ncu_raw_csv.tar.gz" *.csv)
  reps=("$WORK"/*.ncu-rep)
  size=$(cat "${reps[@]}" | wc -c)
  if [ "$size" -lt $(( 15 * 1024 * 1024 )) ]; then
    (cd "$WORK" && tar czf "$OUT/ncu_reports.tar.gz" *.ncu-rep)
  else
    log "reports not copied: $size bytes"
  fi
else
  log "no ncu CSV: see the ncu output above"
fi
cat "$OUT/summary.txt"
log "total: $(elapsed) s"
