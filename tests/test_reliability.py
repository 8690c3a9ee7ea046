"""Careless flags and hostile files through the real CLI (`pipelines.classify.main`,
`pipelines.extract.main`): no row is lost, every refusal is at launch (exit 2, one line,
before the model loads), and a publish that fails leaves what was there before."""

from __future__ import annotations

import glob
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_prefix.pipelines import classify, extract, publish

from conftest import TEXTS


def _rows(n=4):
    return [{"ticket_id": f"T{i}", "text": t} for i, t in enumerate(TEXTS[:n])]


@pytest.fixture
def parquet_in(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(_rows()), path)
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    """Launch checks must end the run before any model loads."""
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _launch_error(main, argv, capsys) -> str:
    assert main(["--runner=DirectRunner", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# -- 1. outputs whose files collide ---------------------------------------------------------

@pytest.mark.parametrize("main,flags", [
    (classify.main, ["--output={d}/out", "--failed_output={d}/out"]),
    (classify.main, ["--output={d}/failed"]),  # the failed rows' default name, beside it
    (classify.main, ["--output={d}/out", "--failed_output={d}/out-bad"]),  # out-*.parquet reads both
    (classify.main, ["--output={d}/out", "--summary_output={d}/out-00000-of-00001.parquet"]),
    (classify.main, ["--output={d}/out", "--failed_output={d}/f", "--summary_output={d}/f-summary.parquet"]),
    (extract.main, ["--output={d}/failed_extract"]),
    (extract.main, ["--output={d}/a", "--failed_output={d}/a"]),
], ids=["failed=output", "output=default-failed", "glob-mixes", "summary=shard", "summary-in-glob", "extract-default",
        "extract-same"])
def test_outputs_that_collide_are_refused_at_launch(tmp_path, main, flags, no_model, capsys):
    out = tmp_path / "o"
    err = _launch_error(main, [f.format(d=out) for f in flags], capsys)
    assert "give them different names" in err
    assert _files(out) == []


# -- 2. publishing: checked, and undone when a rename fails ----------------------------------

def test_summary_output_naming_a_directory_is_refused_at_launch(tmp_path, parquet_in, no_model, capsys):
    (tmp_path / "o" / "summary").mkdir(parents=True)
    err = _launch_error(classify.main, [f"--input={parquet_in}", f"--output={tmp_path}/o/labeled",
                                        f"--summary_output={tmp_path}/o/summary"], capsys)
    assert "--summary_output" in err and "is a directory" in err
    assert _files(tmp_path / "o") == ["summary"]


def _earlier_run(out):
    """What an earlier run left: three shards of the labelled output, its summary."""
    out.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (out / f"labeled-0000{i}-of-00003.parquet").write_bytes(b"old shard %d" % i)
    (out / "labeled-summary.json").write_text('{"old": true}')
    return {name: (out / name).read_bytes() for name in _files(out)}


def test_a_directory_where_a_shard_goes_fails_before_any_rename(tiny_dir, tmp_path, parquet_in, capsys):
    out = tmp_path / "o"
    before = _earlier_run(out)
    (out / "failed-00000-of-00001.parquet").mkdir()
    assert classify.main(["--runner=DirectRunner", f"--input={parquet_in}", f"--model={tiny_dir}",
                          f"--output={out}/labeled", "--verify=false"]) == 1
    err = capsys.readouterr().err
    assert "is a directory" in err and "nothing was published" in err
    assert {n: (out / n).read_bytes() for n in _files(out) if n in before} == before  # untouched
    assert _files(out) == sorted([*before, "failed-00000-of-00001.parquet"])  # no staging left


def test_a_rename_that_fails_midway_is_undone(tiny_dir, tmp_path, parquet_in, monkeypatch, capsys):
    out = tmp_path / "o"
    before = _earlier_run(out)
    moves = []
    real_move = publish._move

    def move(src, dst):
        moves.append((src, dst))
        if len(moves) == 6:  # after the earlier files went aside and two new files went in
            raise PermissionError(13, "Permission denied", dst)
        real_move(src, dst)

    monkeypatch.setattr(publish, "_move", move)
    assert classify.main(["--runner=DirectRunner", f"--input={parquet_in}", f"--model={tiny_dir}",
                          f"--output={out}/labeled", "--verify=false"]) == 1
    err = capsys.readouterr().err
    assert "publishing the outputs failed" in err and "moved back, nothing was published" in err
    assert "these files are final" not in err
    assert _files(out) == sorted(before)  # the earlier run's files, all of them, as they were
    assert {n: (out / n).read_bytes() for n in _files(out)} == before


def test_a_rerun_replaces_the_earlier_runs_shards(tiny_dir, tmp_path, parquet_in):
    out = tmp_path / "o"
    _earlier_run(out)
    summary = classify.run(["--runner=DirectRunner", f"--input={parquet_in}", f"--model={tiny_dir}",
                            f"--output={out}/labeled", "--verify=false"])
    names = _files(out)
    assert [n for n in names if n.startswith("labeled-0")] == ["labeled-00000-of-00001.parquet"]
    assert pq.read_table(out / "labeled-00000-of-00001.parquet").num_rows == summary["labeled"] == 4
    assert json.loads((out / "labeled-summary.json").read_text())["labeled"] == 4
    assert not [n for n in names if n.startswith(".beam-prefix-staging")]


def test_publish_reports_the_final_files_when_it_cannot_undo(tmp_path, monkeypatch):
    staging = publish.Staging([publish.Output("--output", str(tmp_path / "o" / "x"), ".txt")])
    staging.preflight()
    for i in range(2):
        with open(staging.path(str(tmp_path / "o" / f"x-0000{i}-of-00002.txt")), "w") as f:
            f.write("new")
    calls = []

    def move(src, dst):
        calls.append(src)
        if len(calls) == 2 or (len(calls) > 2 and ".beam-prefix-staging" in dst):
            raise OSError("disk gone")
        os.replace(src, dst)

    monkeypatch.setattr(publish, "_move", move)
    with pytest.raises(publish.PublishError) as raised:
        staging.publish()
    assert raised.value.final == [str(tmp_path / "o" / "x-00000-of-00002.txt")]
    assert "these files are final" in str(raised.value)


# -- 3, 4, 5. hostile files -----------------------------------------------------------------

def test_a_deeply_nested_jsonl_line_fails_alone(tiny_dir, tmp_path):
    deep = ['{"id": "deep%d", "text": "x", "meta": %s}' % (n, "[" * n + "]" * n) for n in (100_000, 900)]
    lines = [json.dumps({"id": f"T{i}", "text": t}) for i, t in enumerate(TEXTS[:3])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines[:1] + deep + lines[1:]) + "\n")
    for run, name in ((classify.run, "labeled"), (extract.run, "extracted")):
        summary = run(["--runner=DirectRunner", f"--input={tmp_path}/in.jsonl", f"--model={tiny_dir}",
                       "--id_column=id", f"--output={tmp_path}/{name}/{name}", "--verify=false",
                       *(["--max_new_tokens=4"] if name == "extracted" else [])])
        failed = [r for p in glob.glob(f"{tmp_path}/{name}/failed*.parquet") for r in pq.read_table(p).to_pylist()]
        deep_rows = [r for r in failed if r["stage"] == "read"]
        assert [(r["reason"], "nested too deeply" in r["error"]) for r in deep_rows] == [("unparseable", True)] * 2
        assert summary["rows_read"] == 5 and summary["accounted_for"]


def test_a_csv_header_that_is_not_utf8_is_refused_at_launch(tmp_path, no_model, capsys):
    (tmp_path / "good.csv").write_text("ticket_id,text\nT1,app crashes\n")
    (tmp_path / "in.csv").write_bytes(b"ticket_id,t\xe9xt,text\nT1,a,app crashes\n")
    err = _launch_error(classify.main, [f"--input={tmp_path}/*.csv", f"--output={tmp_path}/o/labeled"], capsys)
    assert f"{tmp_path}/in.csv line 1" in err and "not UTF-8" in err


def test_a_csv_header_that_is_not_utf8_fails_its_rows_at_run_time(tmp_path):
    """A file that appears after launch: its rows fail, named, and the run goes on."""
    from apache_beam.io.filesystem import FileMetadata

    from beam_prefix.pipelines.sources import _ParseCsv

    path = tmp_path / "late.csv"
    path.write_bytes(b"ticket_id,t\xe9xt\nT1,a\nT2,b\n")

    class Readable:
        metadata = FileMetadata(str(path), path.stat().st_size)

        def open(self):
            return open(path, "rb")

    out = list(_ParseCsv("ticket_id").process(Readable()))
    assert [o.tag for o in out] == ["failed", "failed"]
    assert all(o.value["reason"] == "undecodable" and f"{path} line 1" in o.value["error"] for o in out)


def test_a_task_file_nested_thousands_deep_exits_2_naming_it(tmp_path, no_model, capsys):
    task = tmp_path / "deep.yaml"
    task.write_text("name: deep\nlabels: " + "[" * 5000 + "]" * 5000 + "\n")
    err = _launch_error(classify.main, [f"--task={task}", f"--output={tmp_path}/o/labeled"], capsys)
    assert str(task) in err and "nested too deeply" in err
    task.write_text("name: deep\nlabels: [a, b]\nexamples: " + "[" * 40 + "]" * 40 + "\n")  # under YAML's limit
    err = _launch_error(classify.main, [f"--task={task}", f"--output={tmp_path}/o/labeled"], capsys)
    assert str(task) in err and "nested too deeply" in err


# -- 6. a directory as the output prefix ----------------------------------------------------

def test_output_ending_in_a_slash_is_a_directory_with_the_default_names(tiny_dir, tmp_path, parquet_in):
    summary = classify.run(["--runner=DirectRunner", f"--input={parquet_in}", f"--model={tiny_dir}",
                            f"--output={tmp_path}/o/run1/", "--verify=false"])
    assert _files(tmp_path / "o" / "run1") == ["failed-00000-of-00001.parquet", "labeled-00000-of-00001.parquet",
                                               "labeled-summary.json"]
    assert summary["outputs"]["summary"] == f"{tmp_path}/o/run1/labeled-summary.json"
    extract.run(["--runner=DirectRunner", f"--input={parquet_in}", f"--model={tiny_dir}", "--max_new_tokens=2",
                 f"--output={tmp_path}/o/run2/", f"--failed_output={tmp_path}/o/bad/", "--verify=false"])
    assert _files(tmp_path / "o" / "run2") == ["extracted-00000-of-00001.parquet", "extracted-summary.json"]
    assert _files(tmp_path / "o" / "bad") == ["failed_extract-00000-of-00001.parquet"]


# -- 7. column flags checked at launch -------------------------------------------------------

@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_task_column_the_input_lacks_is_refused_at_launch(tmp_path, fmt, no_model, capsys):
    table = pa.Table.from_pylist([{**r, "tenant": "support_tickets"} for r in _rows()])
    if fmt == "parquet":
        pq.write_table(table, tmp_path / "in.parquet")
    else:
        import pyarrow.csv as pacsv
        pacsv.write_csv(table, tmp_path / "in.csv")
    tasks = os.path.join(os.path.dirname(__file__), "..", "pipelines", "tasks")
    err = _launch_error(classify.main, [f"--input={tmp_path}/in.{fmt}", f"--task_dir={tasks}",
                                        "--task_column=tenat", f"--output={tmp_path}/o/labeled"], capsys)
    assert "--task_column" in err and "['tenat']" in err and "tenant" in err


def test_jsonl_column_flags_are_checked_against_the_first_lines(tmp_path, no_model, capsys):
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    for flag in ("--columns_to_keep=ticket_id,text,priorty", "--text_column=body", "--id_column=ticketid"):
        err = _launch_error(classify.main, [f"--input={tmp_path}/in.jsonl", flag, f"--output={tmp_path}/o/l"], capsys)
        assert flag.split("=")[0] in err and "keys of the first 4 JSONL lines" in err


def test_a_jsonl_line_longer_than_the_limit_is_refused_at_launch_in_bounded_time(tmp_path, no_model, capsys):
    """#61.8: a 70 MB first line skipped the key check, then ran for 5 minutes at 1.7 GB."""
    from beam_prefix.pipelines.sources import MAX_LINE_BYTES

    with open(tmp_path / "in.jsonl", "w") as f:
        f.write('{"text": "' + "x" * (MAX_LINE_BYTES + 10) + '"}\n')
        f.write(json.dumps({"text": "app crashes"}) + "\n")
    err = _launch_error(classify.main, [f"--input={tmp_path}/in.jsonl", f"--output={tmp_path}/o/l"], capsys)
    assert f"in.jsonl line 1 is longer than {MAX_LINE_BYTES:,} bytes" in err


def test_a_long_jsonl_line_past_the_sampled_ones_fails_alone_unparsed(tiny_dir, tmp_path, monkeypatch):
    from beam_prefix.pipelines import sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 2000)  # (read by the in-process DirectRunner's DoFn)
    monkeypatch.setattr(sources, "SAMPLED_LINES", 1)
    lines = [json.dumps({"id": "T1", "text": "app crashes"}), json.dumps({"id": "L", "text": "y" * 5000}),
             json.dumps({"id": "T2", "text": "refund please"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = classify.run(["--runner=DirectRunner", f"--input={tmp_path}/in.jsonl", f"--model={tiny_dir}",
                            "--id_column=id", f"--output={tmp_path}/j/l", "--verify=false"])
    failed = pq.read_table(glob.glob(f"{tmp_path}/j/failed-*.parquet")[0]).to_pylist()
    assert [(r["reason"], r["stage"]) for r in failed] == [("too_long", "read")]
    assert (summary["rows_read"], summary["labeled"], summary["failed"]) == (3, 2, 1)


def test_every_csv_file_of_a_glob_is_checked_for_the_text_column_at_launch(tmp_path, no_model, capsys):
    """#61.9: a second file without the text column passed launch and failed each row."""
    (tmp_path / "a.csv").write_text("ticket_id,text\nT1,app crashes\n")
    (tmp_path / "b.csv").write_text("ticket_id,body\nT2,refund please\n")
    err = _launch_error(classify.main, [f"--input={tmp_path}/*.csv", f"--output={tmp_path}/o/l"], capsys)
    assert "--text_column name columns the input lacks: ['text']" in err and f"the CSV header of {tmp_path}/b.csv" in err


# -- 8. the read stage's failed rows, blank lines, empty files --------------------------------

def test_read_failures_keep_their_id(tiny_dir, tmp_path):
    lines = [json.dumps({"id": "T1", "text": "app crashes"}), '{"id": "S1", "text": "a \\ud800"}']
    (tmp_path / "in.jsonl").write_text("\n\n".join(lines) + "\n\n   \n")  # blank lines: skipped
    summary = classify.run(["--runner=DirectRunner", f"--input={tmp_path}/in.jsonl", f"--model={tiny_dir}",
                            "--id_column=id", f"--output={tmp_path}/j/l", "--verify=false"])
    failed = pq.read_table(glob.glob(f"{tmp_path}/j/failed-*.parquet")[0]).to_pylist()
    assert [(r["id"], r["reason"]) for r in failed] == [("S1", "invalid_unicode")]
    assert (summary["rows_read"], summary["labeled"], summary["failed"]) == (2, 1, 1)

    (tmp_path / "in.csv").write_bytes(b"ticket_id,text\nT1,app crashes\nT2,too,many\nT3,caf\xe9\n")
    classify.run(["--runner=DirectRunner", f"--input={tmp_path}/in.csv", f"--model={tiny_dir}",
                  "--id_column=ticket_id", f"--output={tmp_path}/c/l", "--verify=false"])
    failed = pq.read_table(glob.glob(f"{tmp_path}/c/failed-*.parquet")[0]).to_pylist()
    assert sorted((r["id"], r["reason"]) for r in failed) == [("T2", "unparseable"), ("T3", "undecodable")]


@pytest.mark.parametrize("name,content", [("in.csv", ""), ("in.jsonl", ""), ("in.csv", "\n\n"),
                                          ("in.jsonl", "\n  \n")])
def test_empty_csv_and_jsonl_give_the_same_outcome(tiny_dir, tmp_path, name, content, capsys):
    (tmp_path / name).write_text(content)
    assert classify.main(["--runner=DirectRunner", f"--input={tmp_path}/{name}", f"--model={tiny_dir}",
                          f"--output={tmp_path}/o/l", "--verify=false"]) == 0
    assert "rows read 0: labelled 0 + failed 0" in capsys.readouterr().out


# -- a prompt that cannot fit the model: refused at launch -----------------------------------

@pytest.mark.parametrize("main,flags", [
    (classify.main, ["--max_text_tokens=5000"]),
    (extract.main, ["--max_text_tokens=5000"]),
    (extract.main, ["--max_new_tokens=4000"]),
])
def test_a_prompt_longer_than_the_model_is_refused_at_launch(tiny_dir, tmp_path, main, flags, no_model, capsys):
    """The tiny model has 4,096 positions: the same message the workers would give, exit 2."""
    err = _launch_error(main, [f"--model={tiny_dir}", f"--output={tmp_path}/o/x", *flags], capsys)
    assert "over the 4,096 of model" in err and "max_position_embeddings" in err
    assert ("lower max_text_tokens to" in err) == ("--max_text_tokens=5000" in flags)
    assert _files(tmp_path / "o") == []


def test_a_model_that_cannot_load_is_refused_at_launch(tmp_path, no_model, capsys):
    err = _launch_error(classify.main, [f"--model={tmp_path}/no-such-model", f"--output={tmp_path}/o/x"], capsys)
    assert "cannot load the tokenizer" in err and "no-such-model" in err


@pytest.mark.parametrize("runner", ["DaskRunner", "apache_beam.runners.dask.dask_runner.DaskRunner"])
def test_a_runner_that_mixes_tagged_outputs_is_refused_at_launch(tmp_path, runner, no_model, capsys):
    for main in (classify.main, extract.main):
        assert main([f"--runner={runner}", f"--output={tmp_path}/o/x"]) == 2
        err = capsys.readouterr().err
        assert "DaskRunner" in err and "multi-output" in err and "\n" not in err.strip()


# -- a worker killed mid-run ------------------------------------------------------------------

def _process_tree(pid: int) -> list[int]:
    """pid's descendants, from /proc (Linux)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _established_sockets(pid: int) -> int:
    """How many of pid's sockets are established TCP connections (Linux /proc)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        established = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "01":  # ESTABLISHED
                        established.add(fields[9])
    except OSError:
        return 0
    return len(inodes & established)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds worker processes through /proc")
@pytest.mark.parametrize("pipeline,flags", [
    ("classify", ["--runner=DirectRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]),
    ("extract", ["--runner=PortableRunner", "--job_endpoint=embed",
                 "--environment_type=beam:env:harness_subprocess_python:v1",
                 f"--environment_config={sys.executable} -m apache_beam.runners.worker.sdk_worker_main",
                 "--max_new_tokens=16"]),
], ids=["classify-direct-processes", "extract-portable-subprocess"])
def test_a_worker_killed_mid_run_leaves_no_files(tiny_dir, tmp_path, pipeline, flags):
    """A real kill -9 of a worker process: exit 1 with the cause in one line, and no final
    file, no staging directory, no Beam temp file left behind.

    The worker killed is one already connected to the runner (its control, logging and data
    connections established): Beam's runner waits without a timeout for a worker that dies
    before it connects (the first seconds of the process, its imports), so that kill hangs
    the run instead of failing it (seen here under load, and reproduced by killing at once)."""
    import signal
    import subprocess
    import time

    rows = [{"id": f"T{i}", "text": f"ticket {i}: my invoice is wrong and the app crashes"} for i in range(3000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", f"pipelines.{pipeline}", *flags, f"--input={tmp_path}/in.parquet",
                             f"--model={tiny_dir}", f"--output={out}/rows", "--verify=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.join(os.path.dirname(__file__), ".."))
    killed = None
    try:
        deadline = time.time() + 120
        def workers():  # the connected ones
            return [p for p in _process_tree(proc.pid) if "sdk_worker_main" in _cmdline(p)
                    and not _cmdline(p).startswith("/bin/sh") and _established_sockets(p) >= 3]

        while killed is None and time.time() < deadline and proc.poll() is None:
            if workers() and os.path.isdir(out) and os.listdir(out):  # connected, staging exists: under way
                time.sleep(1)
                for pid in workers():  # listed again: one listed before may have ended meanwhile
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    killed = pid
                    break
            time.sleep(0.2)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, "no worker process was found to kill"
    assert proc.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: a worker process died") and "nothing was written" in last, last
    assert _files(out) == []  # no final file, no staging directory (Beam's temp files were in it)


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGUSR2"), reason="the worker watch is POSIX")
@pytest.mark.parametrize("pipeline", ["extract", "fit"])
def test_a_worker_command_that_cannot_start_fails_the_run_instead_of_hanging(tiny_dir, tmp_path, pipeline):
    """A wrong --environment_config: the worker exits 127 before it connects, which Beam's
    runner would wait for forever; the run ends with exit 1, the cause in one line, and no
    files (pipelines.worker_watch)."""
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "o"
    if pipeline == "extract":
        pq.write_table(pa.Table.from_pylist(_rows(8)), tmp_path / "in.parquet")
        flags = [f"--input={tmp_path}/in.parquet", f"--output={out}/rows", "--max_new_tokens=4"]
    else:
        flags = ["--task=support_tickets", f"--input={root}/pipelines/data/sample_tickets.csv", "--label_column=label",
                 f"--output={out}/support.head"]
    proc = subprocess.run([sys.executable, "-m", f"pipelines.{pipeline}", "--runner=PortableRunner", "--job_endpoint=embed",
                           "--environment_type=beam:env:harness_subprocess_python:v1",
                           f"--environment_config={tmp_path}/no-such-python -m apache_beam.runners.worker.sdk_worker_main",
                           f"--model={tiny_dir}", "--verify=false", *flags],
                          capture_output=True, text=True, timeout=180, cwd=root)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a worker process died") and "return code 127" in last, last
    assert pipeline == "fit" or "nothing was written" in last  # fit's one output is its head file
    assert _files(out) == []


@pytest.mark.parametrize("pipeline", ["classify", "fit"])
@pytest.mark.parametrize("state", ["FAILED", "CANCELLED"])
def test_a_job_the_runner_ends_unfinished_writes_nothing(tiny_dir, tmp_path, pipeline, state):
    """A runner that returns a failed or cancelled job instead of raising (wait_until_finish may)
    leaves partial outputs: the run raises naming the state, publishes nothing, and fit fits no
    head from partial features (`launch.run_to_end`)."""
    import apache_beam as beam

    from beam_prefix.pipelines import fit

    class Ended:
        def wait_until_finish(self):
            return state

    class EndsUnfinished(beam.Pipeline):
        def run(self, test_runner_api="AUTO"):
            return Ended()

    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "o"
    argv = [f"--model={tiny_dir}", "--verify=false", f"--input={root}/pipelines/data/sample_tickets.csv"]
    if pipeline == "fit":
        argv += ["--task=support_tickets", "--label_column=label", f"--output={out}/support.head"]
        with pytest.raises(Exception, match=f"in state {state}"):
            fit.run(argv, test_pipeline=EndsUnfinished())
    else:
        argv += ["--task=support_tickets", f"--output={out}/rows"]
        with pytest.raises(Exception, match=f"in state {state}"):
            classify.run(argv, test_pipeline=EndsUnfinished())
    assert _files(out) == []
