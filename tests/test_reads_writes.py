"""No run writes what it reads (round 3): every output of classify, extract and fit that
names, or whose reading pattern matches, an input file, a task file, a head file or a
task directory's task files is refused at launch (exit 2, one line, before the model
loads), and the file it would have replaced is left as it was."""

from __future__ import annotations

import hashlib
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_prefix.pipelines import classify, extract, fit

from conftest import SUPPORT_TASK, TEXTS

TASKS = os.path.dirname(SUPPORT_TASK)


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("beam_prefix.model.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _refused(main, argv, capsys, *protected) -> str:
    before = {p: _digest(p) for p in protected}
    assert main(["--runner=DirectRunner", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "this run reads" in err or "reads as a task file" in err, err
    assert {p: _digest(p) for p in protected} == before  # nothing it reads was touched
    return err


@pytest.fixture
def csv_in(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("ticket_id,text,label\n" + "".join(f"T{i},\"{t}\",billing\n" for i, t in enumerate(TEXTS[:4])
                                                      if '"' not in t))
    return str(path)


@pytest.fixture
def head_task(tmp_path):
    """A copy of the shipped support head task and its head, in a folder of their own."""
    d = tmp_path / "tasks"
    d.mkdir()
    shutil.copy(os.path.join(TASKS, "support_tickets_head.yaml"), d / "support_tickets_head.yaml")
    shutil.copy(os.path.join(TASKS, "support_tickets.head"), d / "support_tickets.head")
    return d


def test_fit_output_naming_its_input_csv_is_refused(tmp_path, csv_in, no_model, capsys):
    err = _refused(fit.main, [f"--input={csv_in}", "--label_column=label", f"--output={csv_in}"], capsys, csv_in)
    assert "--output=" in err and "--input=" in err


def test_fit_output_naming_a_parquet_file_its_input_glob_matches_is_refused(tmp_path, no_model, capsys):
    part = tmp_path / "train-1.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "refund", "label": "billing"}]), part)
    _refused(fit.main, [f"--input={tmp_path}/train-*.parquet", "--label_column=label", f"--output={part}"],
             capsys, part)


def test_fit_output_naming_its_task_file_is_refused(tmp_path, csv_in, no_model, capsys):
    task = tmp_path / "task.yaml"
    shutil.copy(SUPPORT_TASK, task)
    err = _refused(fit.main, [f"--input={csv_in}", f"--task={task}", "--label_column=label", f"--output={task}"],
                   capsys, task)
    assert "--task=" in err


def test_fit_output_through_a_symlink_to_its_input_is_refused(tmp_path, csv_in, no_model, capsys):
    link = tmp_path / "link.head"
    os.symlink(csv_in, link)
    _refused(fit.main, [f"--input={csv_in}", "--label_column=label", f"--output={link}"], capsys, csv_in)


@pytest.mark.parametrize("main", [classify.main, extract.main], ids=["classify", "extract"])
def test_summary_output_naming_the_input_is_refused(tmp_path, csv_in, main, no_model, capsys):
    err = _refused(main, [f"--input={csv_in}", f"--output={tmp_path}/o/out", f"--summary_output={csv_in}"],
                   capsys, csv_in)
    assert "--summary_output=" in err


def test_summary_output_naming_the_tasks_head_is_refused(tmp_path, csv_in, head_task, no_model, capsys):
    head = head_task / "support_tickets.head"
    err = _refused(classify.main, [f"--input={csv_in}", f"--task={head_task}/support_tickets_head.yaml",
                                   f"--output={tmp_path}/o/out", f"--summary_output={head}"], capsys, head)
    assert "the head of --task" in err


def test_summary_output_naming_the_task_file_is_refused(tmp_path, csv_in, no_model, capsys):
    task = tmp_path / "t.yaml"
    shutil.copy(SUPPORT_TASK, task)
    _refused(classify.main, [f"--input={csv_in}", f"--task={task}", f"--output={tmp_path}/o/out",
                             f"--summary_output={task}"], capsys, task)


def test_a_sharded_output_whose_pattern_matches_the_input_is_refused(tmp_path, no_model, capsys):
    part = tmp_path / "labeled-00000-of-00001.parquet"  # an earlier run's output, read as this run's input
    pq.write_table(pa.Table.from_pylist([{"text": "refund"}]), part)
    err = _refused(classify.main, [f"--input={part}", f"--output={tmp_path}/labeled"], capsys, part)
    assert "--output=" in err


def test_failed_output_onto_the_input_is_refused(tmp_path, no_model, capsys):
    part = tmp_path / "failed-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "refund"}]), part)
    _refused(classify.main, [f"--input={part}", f"--output={tmp_path}/o/labeled", f"--failed_output={tmp_path}/failed"],
             capsys, part)


def test_routing_refuses_outputs_onto_a_task_directory(tmp_path, head_task, no_model, capsys):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"text": "refund", "task": "support_tickets_head"}\n')
    flags = [f"--input={rows}", f"--task_dir={head_task}", "--task_column=task", f"--output={tmp_path}/o/out"]
    # onto a routed task's head
    _refused(classify.main, flags + [f"--summary_output={head_task}/support_tickets.head"], capsys,
             head_task / "support_tickets.head")
    # a new file the directory would read as a task next time
    _refused(classify.main, flags + [f"--summary_output={head_task}/summary.yaml"], capsys,
             head_task / "support_tickets_head.yaml")
    assert sorted(os.listdir(head_task)) == ["support_tickets.head", "support_tickets_head.yaml"]


def test_a_run_that_reads_nothing_it_writes_still_launches(tmp_path, csv_in, monkeypatch, capsys):
    """The check refuses overlap only: an output beside the input (another name) is fine,
    and fitting the head a task names (the fit workflow) is not 'writing what it reads'."""
    from beam_prefix.pipelines.launch_checks import Read, input_reads, refuse_overlap, task_reads
    from beam_prefix.pipelines.publish import Output

    refuse_overlap([Output("--output", f"{tmp_path}/labeled", ".parquet"),
                    Output("--summary_output", f"{tmp_path}/labeled-summary.json")],
                   [Read("--input", csv_in)] + task_reads(SUPPORT_TASK))
    # a task of one's own beside its head (a shipped head is refit that way: a copy of its task)
    import shutil

    head_yaml = shutil.copy(os.path.join(TASKS, "support_tickets_head.yaml"), tmp_path / "support_head.yaml")
    shutil.copy(os.path.join(TASKS, "support_tickets.head"), tmp_path / "support_tickets.head")
    refuse_overlap([Output("--output", str(tmp_path / "support_tickets.head"))], task_reads(str(head_yaml), with_head=False))
    assert [r.flag for r in task_reads(str(head_yaml))][-1].startswith("the head of --task")
    from apache_beam.options.pipeline_options import PipelineOptions

    assert [r.flag for r in input_reads(PipelineOptions([]))] == ["the sample input"]
