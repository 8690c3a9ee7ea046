"""No symlink, shared file or spelling turns a run against its user (reliability, round 5,
#61 items 1-3 and 6): a lock never writes through a link or over a file it did not make,
paths are compared as files, not spellings, and no run writes inside the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from beam_prefix.pipelines import classify, fit, tune
from beam_prefix.pipelines.launch_checks import package_directory
from beam_prefix.pipelines.output_lock import LOCK_PREFIX, lock_path, locked
from beam_prefix.pipelines.paths import canonical
from beam_prefix.pipelines.publish import Output, OutputLocationError, Staging
from beam_prefix.tasks.shipped import SHIPPED_TASKS, resolve_task, shipped_tasks

from conftest import ROOT

SAMPLE = os.path.join(ROOT, "pipelines", "data", "sample_tickets.csv")
PACKAGE = ROOT / "beam_prefix"


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("beam_prefix.model.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _refused(main, argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def _classify(out, *more):
    return ["--runner=DirectRunner", f"--input={SAMPLE}", f"--output={out}", *more]


# -- 1 and 6: a lock never follows a link, nor truncates or removes what it did not make ---------

def _plant(kind: str, lock: str, tmp_path) -> tuple[str, bytes | None]:
    """Put `kind` at the lock's path; returns what it is said to be and the victim's bytes."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    if kind == "symlink":
        os.symlink(victim, lock)
        return "a symbolic link", b"precious\n"
    if kind == "dangling symlink":  # into a missing folder: the lock code retried forever at full CPU
        os.symlink(tmp_path / "missing" / "folder" / "x", lock)
        return "a symbolic link", None
    if kind == "directory":
        os.mkdir(lock)
        return "a directory", None
    if kind == "fifo":
        os.mkfifo(lock)
        return "a FIFO", None
    if kind == "hard link":
        os.link(victim, lock)
        return "a hard link", b"precious\n"
    if kind == "foreign file":
        with open(lock, "wb") as f:
            f.write(b"someone's notes\n")
        return "a file that holds something else", None
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "directory", "fifo", "hard link", "foreign file"])
def test_anything_but_a_lock_at_the_lock_path_is_refused_and_left_as_it_is(kind, tmp_path, no_model, capsys):
    out = tmp_path / "D" / "labeled"
    out.parent.mkdir()
    lock = lock_path(str(out))
    assert os.path.basename(lock) == LOCK_PREFIX + "labeled"
    said, victim_bytes = _plant(kind, lock, tmp_path)
    before = os.lstat(lock)
    # in a subprocess with a deadline: the dangling link made the lock code spin forever
    proc = subprocess.run([sys.executable, "-m", "pipelines.classify", *_classify(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert err[-1].startswith("error: ") and f"its lock path {lock} is {said}" in err[-1], err[-1]
    after = os.lstat(lock)  # still there, the same thing
    assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)
    if victim_bytes is not None:
        assert (tmp_path / "victim.txt").read_bytes() == victim_bytes
    assert sorted(os.listdir(out.parent)) == [os.path.basename(lock)]  # nothing staged beside it


def test_an_immutable_file_at_the_lock_path_is_refused_naming_it(tmp_path, no_model, capsys):
    out = tmp_path / "labeled"
    lock = lock_path(str(out))
    with open(lock, "wb"):
        pass
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", lock], capture_output=True).returncode:
        os.remove(lock)
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE)")
    try:
        err = _refused(classify.main, _classify(out), capsys)
        assert f"its lock path {lock} is a file this run cannot write" in err
    finally:
        subprocess.run(["chattr", "-i", lock], check=True)


def test_a_lock_left_by_a_killed_run_is_still_taken_and_only_ours_removed(tmp_path):
    out = str(tmp_path / "labeled")
    lock = lock_path(out)
    with open(lock, "w") as f:  # what a run killed outright leaves: its owner record, no flock held
        f.write('{"pid": 1, "host": "h", "since": "then", "token": "t"}')
    with locked([("--output", out)]):
        assert '"token"' in open(lock).read()
        os.remove(lock)  # someone replaces the lock file while the run holds it
        os.symlink(tmp_path / "elsewhere", lock)
    assert os.path.islink(lock)  # the run removes only the file it locked


# -- 2: paths compared as files, not spellings ------------------------------------------------

def test_an_output_spelled_through_a_link_collides_as_the_same_file(tmp_path, no_model, capsys):
    d = tmp_path / "D"
    d.mkdir()
    os.symlink(d, tmp_path / "L")
    err = _refused(classify.main, _classify(d / "labeled", f"--summary_output={tmp_path}/L/labeled-00000-of-00001"
                                            ".parquet"), capsys)
    assert "--summary_output=" in err and "--output=" in err and "give them different names" in err
    # the failed rows spelled through the link as --output: the overlap message, not the run's own lock
    err = _refused(classify.main, _classify(d / "out", f"--failed_output={tmp_path}/L/out"), capsys)
    assert "write the same files" in err and "being written by" not in err
    assert os.listdir(d) == []


def test_remote_spellings_of_one_path_are_one_path():
    assert canonical("gs://b//x/./y/../z") == canonical("gs://b/x/z") == "gs://b/x/z"
    assert lock_path("gs://b/x//out") == lock_path("gs://b/x/out")
    with pytest.raises(OutputLocationError, match="write the same files"):
        Staging([Output("--output", "gs://b/x/out", ".parquet"),
                 Output("--failed_output", "gs://b//x/./out", ".parquet")]).check()


def test_a_link_into_the_input_is_compared_as_the_input(tmp_path, no_model, capsys):
    shutil.copy(SAMPLE, tmp_path / "in.csv")
    os.symlink(tmp_path, tmp_path / "alias")
    err = _refused(classify.main, ["--runner=DirectRunner", f"--input={tmp_path}/in.csv", f"--output={tmp_path}/o",
                                   f"--summary_output={tmp_path}/alias/in.csv"], capsys)
    assert "which this run reads" in err


# -- 3: no run writes inside the package --------------------------------------------------------

@pytest.mark.parametrize("main,argv", [
    (classify.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--output={tmp}/o",
                     "--summary_output={pkg}/shipped/tasks/banking77.yaml"]),  # (a shipped file this run does not read)
    (classify.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--output={pkg}/shipped/data/labeled"]),
    (classify.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--output={root}/pipelines/tasks/labeled"]),
    (fit.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label",
                "--output={root}/pipelines/tasks/banking77.head"]),
    (fit.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label",
                "--output={pkg}/shipped/tasks/support_tickets.head"]),
    (tune.main, ["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                 "--output={pkg}/shipped/tasks/tuned"]),
    (tune.main, ["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label", "--output={tmp}/t",
                 "--summary_output={pkg}/shipped/summary.json"]),
], ids=["summary-over-shipped-task", "output-in-data", "via-checkout-link", "fit-head-via-link", "fit-head", "tune-output",
        "tune-summary"])
def test_no_run_writes_inside_the_package(main, argv, tmp_path, no_model, capsys):
    before = {p: p.stat().st_mtime_ns for p in PACKAGE.rglob("*") if p.is_file()}
    argv = [a.format(tmp=tmp_path, pkg=PACKAGE, root=ROOT) for a in argv]
    err = _refused(main, argv, capsys)
    assert f"lies inside the installed beam_prefix package ({package_directory()})" in err
    assert {p: p.stat().st_mtime_ns for p in PACKAGE.rglob("*") if p.is_file()} == before


def test_shipped_task_names_are_a_fixed_list(tmp_path, monkeypatch):
    shipped = PACKAGE / "shipped" / "tasks"
    assert sorted(SHIPPED_TASKS) == shipped_tasks() == sorted(p.stem for p in shipped.glob("*.yaml"))
    copy = tmp_path / "shipped"  # the folder with a file dropped in: not a name
    shutil.copytree(PACKAGE / "shipped", copy)
    (copy / "tasks" / "dropped.yaml").write_text("labels: [a, b]\ninstructions: Answer.\n", encoding="utf-8")
    monkeypatch.setattr("beam_prefix.tasks.shipped._shipped_dir", lambda folder: copy / folder)
    assert "dropped" not in shipped_tasks()
    with pytest.raises(Exception, match="no shipped task 'dropped'"):
        resolve_task("dropped")
    assert resolve_task("support_tickets") == str(copy / "tasks" / "support_tickets.yaml")
