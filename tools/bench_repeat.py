"""bench.py in several fresh processes, summarised: a bar read on the synchronized
protocol needs more than one process, because one process's synchronized times
move its ratio by up to ~0.1 between processes (docs/perf.md v94, call 6), and a
process's clocks and allocator state last for all of its cells.

    python tools/bench_repeat.py --processes 3 -- --no-compile --dtype float16 --grad --model 33 --mode both

Everything after `--` goes to bench.py unchanged (except --json, which this tool
sets per process).  The processes run one after another, on the same GPU.  For
every (problem, mode, side) of bench's table it prints the median over the
processes of each process's median, and their range [min - max]:
  ms        back to back (bench's median ms)
  sync ms   synchronized per call (bench's sync ms)
  speedup   eager / side, both protocols (each process's own ratio, so a process's
            shared state cancels)
and ModelNew's time over the floor's (back to back) where bench has a floor side.
It writes every process's JSON and the summary to --json (default
results/bench_repeat.json).  Exit status: the first nonzero status of a bench
process (1: ModelNew not close to eager; 2: no GPU), else 0.  Runs no GPU work
itself."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench.py")
# bench.py's per-side numbers summarised here (a key absent from a row is skipped).
FIELDS = (("median_ms", "ms"), ("sync_median_ms", "sync ms"), ("speedup_vs_eager", "speedup"),
          ("sync_speedup_vs_eager", "sync speedup"))


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=3, help="bench.py processes to run (default: 3)")
    p.add_argument("--json", default=os.path.join("results", "bench_repeat.json"), metavar="PATH",
                   help="where to write every process's results and the summary")
    p.add_argument("--bench", default=BENCH, help=argparse.SUPPRESS)  # tests run a stand-in
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if "--json" in bench_args or any(a.startswith("--json=") for a in bench_args):
        p.error("--json after `--` is this tool's to set (one file per process); give it before `--`")
    if "--sweep" in bench_args:
        p.error("--sweep writes its own files per shape; run bench.py --sweep directly")
    args.bench_args = bench_args
    return args


def spread(values):
    """(median, min, max) of a list of numbers."""
    return statistics.median(values), min(values), max(values)


def summarise(runs):
    """Per (model, mode, side) of the runs' rows (bench.py's JSON, one per process, in order):
    {"model", "mode", "side", <field>: [median, min, max], ...}; and per (model, mode) the
    spread of ModelNew's time over the floor where the checks have it.  Returns (rows, floors)."""
    cells = {}
    for run in runs:
        for row in run["rows"]:
            key = (row.get("model"), row.get("mode"), row.get("side"))
            cell = cells.setdefault(key, {})
            for field, _ in FIELDS:
                if isinstance(row.get(field), (int, float)):
                    cell.setdefault(field, []).append(row[field])
    rows = [dict({"model": model, "mode": mode, "side": side, "processes": max(map(len, cell.values()), default=0)},
                 **{field: list(spread(values)) for field, values in cell.items()})
            for (model, mode, side), cell in cells.items()]
    floors = {}
    for run in runs:
        for check in run.get("checks", []):
            if "modelnew_time_over_floor" in check:
                floors.setdefault((check.get("model"), check.get("mode")), []).append(check["modelnew_time_over_floor"])
    return rows, [{"model": model, "mode": mode, "modelnew_time_over_floor": list(spread(values))}
                  for (model, mode), values in floors.items()]


def format_summary(rows, floors, processes):
    """The printed table: one line per (problem, mode, side)."""
    lines = [f"over {processes} processes: median of the processes' medians [min - max]"]
    head = f"{'problem':<8}{'mode':<7}{'side':<10}" + "".join(f"{label:>26}" for _, label in FIELDS)
    lines.append(head)
    for row in rows:
        cols = []
        for field, label in FIELDS:
            if field not in row:
                cols.append(f"{'-':>26}")
                continue
            mid, lo, hi = row[field]
            unit = "x" if "speedup" in field else ""
            cols.append(f"{f'{mid:.3f}{unit} [{lo:.3f}-{hi:.3f}]':>26}")
        lines.append(f"{str(row['model']):<8}{str(row['mode']):<7}{str(row['side']):<10}" + "".join(cols))
    for f in floors:
        mid, lo, hi = f["modelnew_time_over_floor"]
        lines.append(f"problem {f['model']} {f['mode']}: ModelNew over the floor (back to back) "
                     f"{mid:.3f} [{lo:.3f}-{hi:.3f}]")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    runs, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            path = os.path.join(tmp, f"bench_{i}.json")
            cmd = [sys.executable, args.bench, *args.bench_args, "--json", path]
            print(f"process {i + 1} of {args.processes}: {' '.join(cmd[1:])}", flush=True)
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code != 0 and status == 0:
                status = code
            if not os.path.exists(path):
                print(f"bench_repeat: process {i + 1} wrote no results (exit status {code}); stopping",
                      file=sys.stderr)
                return status or 1
            with open(path) as f:
                runs.append(json.load(f))
    rows, floors = summarise(runs)
    print("\n" + format_summary(rows, floors, len(runs)))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"bench_args": args.bench_args, "processes": runs, "summary": rows, "floors": floors}, f, indent=2)
    print(f"\nwrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
