"""Remote paths fail fast when unreachable (#56.11): every gs:// path a run names (outputs,
input, task, model) must answer within a deadline at launch, or the run exits 2 with one
line naming the flag, instead of a client's minutes of retries and then its raw error;
pipelines.fit's --output is checked too."""

from __future__ import annotations

import threading
import time

import pytest
from apache_beam.io.filesystems import FileSystems

from beam_prefix.pipelines import classify, extract, fit
from beam_prefix.pipelines.launch_checks import refuse_unreachable
from beam_prefix.pipelines.publish import OutputLocationError

from conftest import ROOT

SAMPLE = str(ROOT / "pipelines" / "data" / "sample_tickets.csv")


@pytest.fixture
def hanging(monkeypatch):
    """FileSystems.match never answers for gs:// paths (released when the test ends)."""
    release, asked = threading.Event(), []
    real = FileSystems.match

    def match(patterns, *args, **kwargs):
        if any(str(p).startswith("gs://") for p in patterns):
            asked.extend(patterns)
            release.wait(120)
            raise TimeoutError("released")
        return real(patterns, *args, **kwargs)

    monkeypatch.setattr(FileSystems, "match", staticmethod(match))
    monkeypatch.setenv("BEAM_PREFIX_REMOTE_TIMEOUT_S", "1")
    yield asked
    release.set()


@pytest.mark.parametrize("main, flags", [
    (classify.main, ["--output=gs://bucket/out/labeled"]),
    (extract.main, ["--output=gs://bucket/out/extracted"]),
    (classify.main, ["--model=gs://bucket/models/qwen", "--output={tmp}/o"]),
    (classify.main, ["--task=gs://bucket/tasks/support.yaml", "--output={tmp}/o"]),
    (fit.main, ["--label_column=label", "--output=gs://bucket/heads/support.head"]),
], ids=["classify-output", "extract-output", "model", "task", "fit-output"])
def test_an_unreachable_remote_path_is_refused_within_the_deadline(main, flags, hanging, tmp_path, capsys):
    start = time.monotonic()
    code = main(["--runner=DirectRunner", f"--input={SAMPLE}", *(f.format(tmp=tmp_path) for f in flags)])
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2 and "no answer from its file system within 1 s" in err, err[-1000:]
    assert took < 20 and hanging  # the deadline, not the client's retries
    flag = next(f.split("=")[0] for f in flags if "gs://" in f)
    assert f"{flag}=gs://bucket/" in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was staged


def test_a_remote_error_is_named_and_an_answer_passes(monkeypatch):
    def failing(patterns, *args, **kwargs):
        raise PermissionError("403 caller does not have storage.objects.list access")

    monkeypatch.setattr(FileSystems, "match", staticmethod(failing))
    with pytest.raises(OutputLocationError, match=r"--output=gs://b/o: cannot be reached \(PermissionError: 403"):
        refuse_unreachable([("--output", "gs://b/o")], timeout=5)
    monkeypatch.setattr(FileSystems, "match", staticmethod(lambda patterns, *a, **k: []))
    refuse_unreachable([("--output", "gs://b/o"), ("--model", "gs://b/m")], timeout=5)  # answered: no refusal


def test_a_remote_head_named_in_a_task_file_is_probed_at_launch(hanging, tmp_path, capsys):
    """#61.7: a gs:// head inside a task file was not probed: 242 s, then a raw BeamIOError."""
    from beam_prefix.tasks.shipped import resolve_task

    task = tmp_path / "remote_head.yaml"
    task.write_text(open(resolve_task("support_tickets_head"), encoding="utf-8").read()
                    .replace("head: support_tickets.head", "head: gs://bucket/heads/support.head"), encoding="utf-8")
    assert "gs://bucket/heads/support.head" in task.read_text()
    start = time.monotonic()
    code = classify.main(["--runner=DirectRunner", f"--input={SAMPLE}", f"--task={task}", f"--output={tmp_path}/o"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 20, err[-1000:]
    assert f"the head of --task={task}=gs://bucket/heads/support.head: no answer from its file system" in err
    assert not (tmp_path / "o").exists()


def test_dataflows_staging_location_is_probed_before_the_runner_is_built(hanging, tmp_path, monkeypatch, capsys):
    """#62.2: the documented Dataflow command exited 1 after 139 s offline: building the
    DataflowRunner checks its staging bucket with minutes of retries, before any check ran."""
    import apache_beam as beam

    monkeypatch.setattr(beam, "Pipeline", lambda *a, **k: pytest.fail("the runner was built before the probe"))
    start = time.monotonic()
    code = classify.main(["--runner=DataflowRunner", "--project=p", "--region=r", "--temp_location=gs://bucket/tmp",
                          f"--input={SAMPLE}", "--output=gs://bucket/out/labeled"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 20, err[-1000:]
    assert "no answer from its file system within 1 s" in err and "gs://bucket/" in err
