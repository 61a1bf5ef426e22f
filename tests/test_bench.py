"""The benchmark runs end to end at a small size (its figures are not judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref

import pytest

from conftest import mounted
from tensorferry import bench
from tensorferry.errors import TensorferryError


@pytest.mark.parametrize("what,extra", [("engine", ["--backends", "threads"]), ("checkpoint", ["--counts", "8"])])
def test_bench_runs_and_reports_json(tmp_path, tmp_path_factory, what: str, extra: list[str]) -> None:
    results_dir = tmp_path_factory.mktemp("results")
    cmd = [sys.executable, "-m", "tensorferry.bench", what, "--dir", str(tmp_path), "--size", "8M", "--json",
           "--repeat", "2", "--results", str(results_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    [saved] = results_dir.iterdir()
    document = bench.load_results(str(saved))
    assert document["benchmark"] == what and document["command"].startswith(f"python -m tensorferry.bench {what}")
    assert document["settings"]["size"] == 8 << 20 and document["settings"]["repeat"] == 2
    assert document["machine"]["cpus"] >= 1 and document["machine"]["filesystem"]
    contenders = {(r["name"], r["op"]) for r in rows}
    assert len(document["measurements"]) == 2 * len(contenders), "every round's measurements are kept"
    assert document["results"] == rows, "the file holds what was printed"
    names = {r["name"].split(" [")[0] for r in rows}
    assert {r["op"] for r in rows} == ({"write", "read"} if what == "engine" else {"write", "read", "hash"})
    assert all(r["gbps"] > 0 and r["nbytes"] > 0 for r in rows)
    if bench.fio_available():
        assert "fio" in names
        assert all(r["ratio_to_fio"] is not None for r in rows if r["op"] != "hash")
    expected = ({"tensorferry threads"} if what == "engine"
                else {"tensorferry save", "tensorferry load", "tensorferry load in place"})
    assert expected <= names
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the benchmark cleans up after itself"


@pytest.mark.parametrize("bad", [["engine", "--size", "abc"], ["engine", "--size", "1M", "--backends", "foo"],
                                 ["engine", "--size", "1M", "--backends", ","],
                                 ["paired", "--size", "1M", "--rounds", "0"],
                                 ["checkpoint", "--size", "1M", "--counts", "0"],
                                 ["checkpoint", "--size", "1M", "--counts", "8,x"],
                                 ["engine", "--size", "1M", "--repeat", "0"]])
def test_bad_arguments_are_refused_before_anything_is_made(tmp_path, capsys, bad: list[str]) -> None:
    directory = tmp_path / "bench"
    with pytest.raises(SystemExit) as exited:
        bench.main([*bad, "--dir", str(directory)])
    assert exited.value.code == 2 and f"error: argument {bad[-2]}" in capsys.readouterr().err
    assert not directory.exists()


def test_checksum_cost_runs(tmp_path) -> None:
    cmd = [sys.executable, "-m", "tensorferry.bench", "checksums", "--dir", str(tmp_path), "--size", "4M",
           "--counts", "8", "--pairs", "2", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["arrays"] == 8 and row["with_s"] > 0 and row["without_s"] > 0 and len(row["pair_differences_s"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_paired_saves_runs(tmp_path) -> None:
    if not bench.fio_available():
        pytest.skip("fio is not installed: there is nothing to pair the saves with")
    cmd = [sys.executable, "-m", "tensorferry.bench", "paired", "--dir", str(tmp_path), "--size", "4M",
           "--counts", "8", "--rounds", "2", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["arrays"] == 8 and len(row["ratios"]) == 2 and row["median_ratio"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_reader_rounds_times_every_reader_and_keeps_the_best(tmp_path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (1 << 20))
    calls = []
    rows = bench.reader_rounds(str(tmp_path), [str(path)], 1 << 20,
                               {"plain read": lambda: calls.append(len(path.read_bytes()))}, repeat=2)
    assert calls == [1 << 20, 1 << 20]
    names = [m.name for m in rows]
    assert names.count("plain read") == 1 and all(m.op == "read" for m in rows)
    assert ("fio" in names) == bench.fio_available()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_best_of_keeps_the_fastest_round_and_the_median_same_round_ratio() -> None:
    def m(name: str, gbps: float) -> bench.Measurement:
        return bench.Measurement(name, "write", 10**9, 1 / gbps, 0.0)

    rounds = [m("fio", 2.0), m("ours", 1.0), m("fio", 1.0), m("ours", 1.5), m("fio", 4.0), m("ours", 2.0)]
    fio, ours = bench.best_of(rounds)
    assert fio.gbps == 4.0 and fio.median_round_ratio is None
    # Best 2.0 against fio's best 4.0, but the rounds' own ratios are 0.5, 1.5 and 0.5.
    assert ours.gbps == 2.0 and ours.median_round_ratio == 0.5
    assert "median same-round vs fio" in bench.report([fio, ours])


def test_rounds_beside_fio_runs_fio_before_each_round_and_cleans_up(tmp_path) -> None:
    seen = []

    def action() -> float:
        seen.append(os.listdir(tmp_path))  # fio's file is there, made by the run just before
        return 0.5

    times, fio = bench.rounds_beside_fio(action, str(tmp_path), 1 << 20, 3, ("write", "read"))
    assert times == [0.5] * 3
    if bench.fio_available():
        assert len(fio) == 3 and all(f > 0 for f in fio) and all(files for files in seen)
    else:
        assert fio == []
    assert os.listdir(tmp_path) == []


def _fake_fio(monkeypatch, report: dict) -> None:
    """fio's JSON report stands as given; other commands run as usual."""
    real = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[0] != "fio":
            return real(cmd, *args, **kwargs)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(report), "")

    monkeypatch.setattr(bench.subprocess, "run", run)


def test_fio_is_timed_by_its_runtime_of_the_op_which_a_run_under_a_millisecond_does_not_make_zero(
        tmp_path, monkeypatch) -> None:
    # As fio 3.33 reported 1 MiB written to /dev/shm: its whole-ms job_runtime was 0.
    _fake_fio(monkeypatch, {"jobs": [{"error": 0, "job_runtime": 0, "write": {"runtime": 1, "io_bytes": 1 << 20}}]})
    monkeypatch.setattr(bench, "_fio_coarse_sizes", set(), raising=False)
    with pytest.warns(UserWarning, match="a larger --size times it better"):
        measured = bench.run_fio(str(tmp_path), "write", 1 << 20)
    assert measured.seconds == 0.001 and measured.gbps > 0
    _fake_fio(monkeypatch, {"jobs": [{"error": 0, "job_runtime": 0, "write": {"runtime": 0, "io_bytes": 0}}]})
    with pytest.raises(TensorferryError, match="fio timed no write"):
        bench.run_fio(str(tmp_path), "write", 1 << 20)


@pytest.mark.skipif(not bench.fio_available(), reason="fio is not installed")
def test_a_failed_fio_run_is_an_error_with_fios_own_message(tmp_path) -> None:
    not_a_folder = tmp_path / "plain"
    not_a_folder.write_bytes(b"")
    with pytest.raises(TensorferryError, match=r"fio could not write .*plain/fio\.bin .*Not a directory"):
        bench.run_fio(str(not_a_folder), "write", 1 << 20)


@pytest.mark.skipif(not bench.fio_available(), reason="fio is not installed")
def test_a_full_disk_ends_the_benchmark_with_fios_message(small_tmpfs, capsys) -> None:
    assert bench.main(["engine", "--dir", small_tmpfs, "--size", "8M", "--backends", "threads"]) == 2
    said = capsys.readouterr().err
    assert "error: fio could not write" in said and "No space left on device" in said


@pytest.mark.skipif(not bench.fio_available(), reason="fio is not installed")
def test_fio_runs_buffered_where_the_filesystem_refuses_o_direct(monkeypatch) -> None:
    from tensorferry import DirectIOFallbackWarning

    monkeypatch.setattr(bench, "_fio_buffered_filesystems", set(), raising=False)  # mount numbers are reused
    with mounted("ramfs") as directory:  # ramfs has no O_DIRECT
        with pytest.warns(DirectIOFallbackWarning, match="fio runs buffered"):
            written = bench.fio_rows(directory, 1 << 20)
        assert [m.op for m in written] == ["write", "read"] and all(m.seconds > 0 for m in written)
        assert os.listdir(directory) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_in_turn_balances_places_and_predecessors(n: int) -> None:
    rounds = [bench.in_turn(list(range(n)), turn) for turn in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(r) == list(range(n)) for r in rounds)
    places = {(r[i], i) for r in rounds for i in range(n)}
    assert len(places) == n * n  # every contender in every place
    pairs = [(r[i], r[i + 1]) for r in rounds for i in range(n - 1)]
    assert {p: pairs.count(p) for p in pairs} == {p: len(rounds) // n for p in set(pairs)}
    assert len(set(pairs)) == n * (n - 1)  # each follows every other, equally often


def _report_module():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "report.py")
    spec = importlib.util.spec_from_file_location("benchmarks_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_renders_the_newest_result_of_each_benchmark(tmp_path) -> None:
    report = _report_module()
    results = tmp_path / "results"

    def run(save_gbps: float, started: float, repeat: int = 2) -> None:
        rounds = []
        for fio_gbps in (2.0, 1.0):  # two rounds: fio, then the save, each time
            rounds += [bench.Measurement("fio [8 arrays]", "write", 10**9, 1 / fio_gbps, 0.2),
                       bench.Measurement("tensorferry save [8 arrays]", "write", 10**9, 1 / save_gbps, 0.3, 5 << 20)]
        bench.save_results(str(results), "checkpoint", ["python", "-m", "tensorferry.bench", "checkpoint", "--dir",
                                                        "/nvme/x", "--size", "1G"], {"size": 1 << 30, "repeat": repeat},
                           str(tmp_path), started, measurements=rounds)

    run(9.0, 999_999_000, repeat=5)  # other settings: in no range
    run(1.0, 1_000_000_000)  # older: only in the range across runs
    run(3.0, 1_000_000_100)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold table\n{report.README_END}\nrest\n")
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out), "--readme", str(readme), "--plot", "",
                        "--gpu-doc", ""]) == 0
    page = out.read_text()
    assert "--dir DIR --size 1G" in page and "/nvme/x" not in page
    assert "| tensorferry save | write | 3.00 (3.00) | 2.25 | 0.30 | 2 |" in page  # median of 1.5 and 3.0
    assert "1.00 (1.00)" not in page, "the older run is not shown"
    across = page[page.index("#### checkpoint: across runs"):]
    assert "Over the newest 2 runs" in across
    assert "| tensorferry save | write | 2 | 1.00-3.00 | 0.75-2.25 |  | 0.30 |" in across  # each run's medians
    text = readme.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "| tensorferry save | 3.00, 2.25, 0.30 |" in text  # a row per contender, a column per state and op


@pytest.mark.parametrize("folder", ["absent", "empty"])
def test_report_refuses_a_results_folder_without_results_and_writes_nothing(tmp_path, capsys, folder: str) -> None:
    report = _report_module()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.json").write_text('{"not": "a result"}')
    readme, out = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(f"{report.README_START}\nthe table\n{report.README_END}\n")
    out.write_text("the page\n")
    assert report.main(["--results", str(tmp_path / folder), "--out", str(out), "--readme", str(readme),
                        "--plot", "", "--gpu-doc", ""]) == 2
    assert "nothing was written" in capsys.readouterr().err
    assert "the table" in readme.read_text() and out.read_text() == "the page\n"


def test_report_skips_a_json_file_that_is_not_a_result_with_a_note(tmp_path, capsys) -> None:
    report = _report_module()
    results = tmp_path / "results"
    bench.save_results(str(results), "engine", ["python", "-m", "tensorferry.bench", "engine"], {"size": 1 << 30},
                       str(tmp_path), 1_000_000_000,
                       measurements=[bench.Measurement("fio", "write", 10**9, 1.0, 0.1)])
    (results / "settings.json").write_text('{"backend": "threads"}')
    (results / "broken.json").write_text("{")
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out), "--readme", "", "--plot", "",
                        "--gpu-doc", ""]) == 0
    notes = capsys.readouterr().err
    assert "settings.json is not a tensorferry benchmark result" in notes and "broken.json" in notes
    assert "### engine" in out.read_text()


def test_report_puts_the_newest_gpu_check_into_its_document(tmp_path, capsys) -> None:
    import glob
    import os
    import shutil

    report = _report_module()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    committed = sorted(glob.glob(os.path.join(root, "benchmarks", "results", "gpu", "*-gpu_check.json")))
    assert committed, "the record of the H200 run is committed"
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    shutil.copy(committed[-1], tmp_path / "results" / "gpu" / os.path.basename(committed[-1]))
    doc = tmp_path / "gpu.md"
    doc.write_text(f"# GPU\n{report.GPU_START}\nold\n{report.GPU_END}\nafter\n")
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path / "b.md"), "--readme", "",
                        "--plot", "", "--gpu-doc", str(doc)]) == 0
    text = doc.read_text()
    assert "old" not in text and text.endswith(f"{report.GPU_END}\nafter\n")
    assert os.path.basename(committed[-1]) in text and "#### save from GPU (bench_gpu)" in text
    assert "| tensorferry save (one file) |" in text and "target: >= 0.9 of fio's write" in text
    assert report.main(["--gpu-check", committed[-1]]) == 0
    assert capsys.readouterr().out.startswith("GPU check of ")


def test_a_timed_step_starts_with_the_earlier_steps_garbage_collected() -> None:
    # Left for the collector, it would be walked in whichever step set off the next full
    # collection: that step would pay for the steps before it.
    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    alive = weakref.ref(cycle)
    del cycle
    seen = []
    bench.timed("probe", "read", 0, lambda: seen.append(alive()))
    assert seen == [None]


def test_bench_without_a_dir_removes_its_temporary_one() -> None:
    import os
    import tempfile

    before = set(os.listdir(tempfile.gettempdir()))
    cmd = [sys.executable, "-m", "tensorferry.bench", "engine", "--backends", "threads", "--size", "4M"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert set(os.listdir(tempfile.gettempdir())) == before


def test_free_page_reporting_is_held_back_during_a_run_and_restored(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "parameters"
    folder.mkdir()
    for name, value in {"min_free_ms": "0", "max_waiting_mib": "1024", "page_reporting_order": "9"}.items():
        (folder / name).write_text(value + "\n")
    monkeypatch.setattr(bench, "PAGE_REPORTING", str(folder))
    with pytest.raises(RuntimeError, match="a failed run"):
        with bench.freed_memory_kept() as held:
            assert held == {"page_reporting_order": "9", **bench.HELD_PAGE_REPORTING}
            assert (folder / "min_free_ms").read_text() == bench.HELD_PAGE_REPORTING["min_free_ms"]
            during = bench.machine_info(str(tmp_path))  # a result saved inside the run
            assert during["free_page_reporting"]["min_free_ms"] == "0"
            assert during["free_page_reporting_during_run"] == held
            raise RuntimeError("a failed run")
    assert (folder / "min_free_ms").read_text() == "0" and (folder / "max_waiting_mib").read_text() == "1024"
    info = bench.machine_info(str(tmp_path))
    assert info["free_page_reporting"]["min_free_ms"] == "0"
    assert info["free_page_reporting_during_run"] == held


HOLDING = """
import sys
from tensorferry import bench
bench.PAGE_REPORTING = sys.argv[1]
with bench.freed_memory_kept():
    print("holding", flush=True)
    sys.stdin.readline()
"""


def test_overlapping_runs_leave_the_settings_the_first_found(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "parameters"
    folder.mkdir()
    for name, value in {"min_free_ms": "0", "max_waiting_mib": "1024", "page_reporting_order": "9"}.items():
        (folder / name).write_text(value)
    monkeypatch.setattr(bench, "PAGE_REPORTING", str(folder))

    def settings() -> dict[str, str]:
        return {name: (folder / name).read_text().strip() for name in bench.HELD_PAGE_REPORTING}

    original = settings()
    other = None
    try:
        with bench.freed_memory_kept():
            with bench.freed_memory_kept():  # nested in this process
                pass
            assert settings() == bench.HELD_PAGE_REPORTING, "the outer run still holds"
            other = subprocess.Popen([sys.executable, "-c", HOLDING, str(folder)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            assert other.stdout.readline() == "holding\n"
        assert settings() == bench.HELD_PAGE_REPORTING, "another process's run still holds"
        assert bench.machine_info(str(tmp_path))["free_page_reporting"]["min_free_ms"] == "0"
        other.communicate("\n", timeout=60)
        assert other.returncode == 0
    finally:
        if other is not None and other.poll() is None:
            other.kill()
    assert settings() == original, "the last run to end put back what the first found"
    assert not os.path.exists(bench._page_reporting_record())


def test_without_free_page_reporting_nothing_is_held(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "PAGE_REPORTING", str(tmp_path / "absent"))
    with bench.freed_memory_kept() as held:
        assert held is None
    assert bench.machine_info(str(tmp_path))["free_page_reporting"] is None


def test_results_name_the_commit_of_a_checkout_that_holds_the_code_or_of_the_build(tmp_path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "another project")
    installed = tmp_path / "site-packages" / "tensorferry" / "bench.py"  # an install inside pyenv's repo
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    assert bench._source_commit(str(installed)) is None
    (installed.parent / "build_commit.txt").write_text("1234abcd+dirty")  # what the build recorded
    assert bench._source_commit(str(installed)) == "1234abcd+dirty"
    (installed.parent / "build_commit.txt").unlink()
    git("add", str(installed))
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "tracked")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert bench._source_commit(str(installed)) == head.strip()
    installed.write_text("changed")
    assert bench._source_commit(str(installed)) == head.strip() + "+dirty"


def test_memory_phase_benchmark_runs(tmp_path) -> None:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "bench_memory_phase.py")
    result = subprocess.run([sys.executable, script, "--dir", str(tmp_path), "--size", "8M", "--repeat", "1"],
                            capture_output=True, text=True, timeout=300)
    if result.returncode and "no O_DIRECT here" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.endswith(")")]
    assert len(lines) == 6 and {line.split()[-5] for line in lines} == {"write", "read"}, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the benchmark cleans up after itself"
