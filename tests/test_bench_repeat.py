"""tools/bench_repeat.py without a GPU: its argument rules, its summary over processes,
and a whole run against a stand-in for bench.py that writes bench's JSON layout."""
import json
import textwrap

import pytest

from tools import bench_repeat

FAKE_BENCH = textwrap.dedent('''
    import json, os, sys
    args = sys.argv[1:]
    path = args[args.index("--json") + 1]
    counter = os.path.join(os.path.dirname(os.environ["FAKE_BENCH_LOG"]), "count")
    n = len(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "a").write("x")
    with open(os.environ["FAKE_BENCH_LOG"], "a") as f:
        f.write(" ".join(args) + "\\n")
    if os.environ.get("FAKE_BENCH_SILENT") == str(n):
        sys.exit(3)
    rows = [{"model": "33", "mode": "train", "side": side, "median_ms": ms * (1 + n), "sync_median_ms": 2 * ms,
             "speedup_vs_eager": 0.2 / (ms * (1 + n)) , "sync_speedup_vs_eager": 1.0}
            for side, ms in (("eager", 0.2), ("ModelNew", 0.1))]
    checks = [{"model": "33", "mode": "train", "modelnew_time_over_floor": 1.0 + n / 10}]
    json.dump({"rows": rows, "checks": checks}, open(path, "w"))
    sys.exit(1 if os.environ.get("FAKE_BENCH_FAIL") == str(n) else 0)
''')


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    log = tmp_path / "log" / "calls.txt"
    log.parent.mkdir()
    monkeypatch.setenv("FAKE_BENCH_LOG", str(log))
    return script, log


def test_arguments_after_the_separator_go_to_bench():
    args = bench_repeat.parse_args(["--processes", "2", "--", "--dtype", "float16", "--grad"])
    assert args.processes == 2 and args.bench_args == ["--dtype", "float16", "--grad"]


@pytest.mark.parametrize("argv", [["--processes", "0"], ["--", "--json", "x.json"], ["--", "--json=x.json"],
                                  ["--", "--sweep"]])
def test_refused_arguments(argv):
    with pytest.raises(SystemExit) as info:
        bench_repeat.parse_args(argv)
    assert info.value.code == 2


def test_summary_takes_the_median_and_range_of_the_processes():
    runs = [{"rows": [{"model": "84", "mode": "eval", "side": "ModelNew", "median_ms": v, "sync_median_ms": 2 * v}],
             "checks": [{"model": "84", "mode": "eval", "modelnew_time_over_floor": f}]}
            for v, f in ((0.3, 1.2), (0.1, 1.0), (0.2, 1.1))]
    rows, floors = bench_repeat.summarise(runs)
    assert rows == [{"model": "84", "mode": "eval", "side": "ModelNew", "processes": 3,
                     "median_ms": [0.2, 0.1, 0.3], "sync_median_ms": [0.4, 0.2, 0.6]}]
    assert floors == [{"model": "84", "mode": "eval", "modelnew_time_over_floor": [1.1, 1.0, 1.2]}]
    text = bench_repeat.format_summary(rows, floors, 3)
    assert "0.200 [0.100-0.300]" in text and "1.100 [1.000-1.200]" in text


def test_a_run_of_three_processes(fake_bench, tmp_path, capsys):
    script, log = fake_bench
    out = tmp_path / "summary.json"
    status = bench_repeat.main(["--processes", "3", "--json", str(out), "--bench", str(script), "--",
                                "--model", "33", "--grad"])
    assert status == 0
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all(c.startswith("--model 33 --grad --json ") for c in calls)
    assert len({c.split()[-1] for c in calls}) == 3  # one JSON file per process
    saved = json.loads(out.read_text())
    assert len(saved["processes"]) == 3 and saved["bench_args"] == ["--model", "33", "--grad"]
    new = next(r for r in saved["summary"] if r["side"] == "ModelNew")
    assert new["median_ms"] == pytest.approx([0.2, 0.1, 0.3])
    assert saved["floors"][0]["modelnew_time_over_floor"] == pytest.approx([1.1, 1.0, 1.2])
    assert "over 3 processes" in capsys.readouterr().out


def test_a_failing_process_gives_its_status(fake_bench, tmp_path, monkeypatch):
    script, _ = fake_bench
    monkeypatch.setenv("FAKE_BENCH_FAIL", "1")
    assert bench_repeat.main(["--processes", "3", "--json", str(tmp_path / "s.json"), "--bench", str(script)]) == 1
    assert (tmp_path / "s.json").exists()


def test_a_process_without_results_stops_the_run(fake_bench, tmp_path, monkeypatch):
    script, log = fake_bench
    monkeypatch.setenv("FAKE_BENCH_SILENT", "1")
    assert bench_repeat.main(["--processes", "3", "--json", str(tmp_path / "s.json"), "--bench", str(script)]) == 3
    assert len(log.read_text().splitlines()) == 2 and not (tmp_path / "s.json").exists()
