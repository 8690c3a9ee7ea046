"""Task files: the default loads; malformed ones fail with errors that name the problem."""

import pytest

from beam_prefix import TaskSpec, TaskSpecError
from beam_prefix.task import DEFAULT_CALIBRATION_TEXTS

from conftest import SUPPORT_TASK


def _write(tmp_path, text):
    path = tmp_path / "task.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_default_task_loads():
    task = TaskSpec.from_yaml(SUPPORT_TASK)
    assert task.name == "support_tickets"
    assert task.label_names == ("billing", "technical", "account")
    assert len(task.examples) == 6
    assert task.render_suffix("hi {there}") == "Ticket: hi {there}"  # user text is never formatted


@pytest.mark.parametrize("text,match", [
    ("labels: [a, b\ninstructions: x", "not valid YAML"),
    ("instructions: classify\n", "no 'labels' field"),
    ("instructions: classify\nlabels: []\n", "at least two labels"),
    ("labels: [only]\n", "at least two labels"),
    ("labels: [spam, ham, spam]\n", "duplicate label 'spam'"),
    ("labels: [spam, ham]\nsuffix_template: 'Message:'\n", "exactly one {text} slot"),
    ("labels: [spam, ham]\nsuffix_template: '{text} {text}'\n", "exactly one {text} slot"),
    ("labels: [spam, ham]\nsuffix_template: '{text} {other}'\n", "exactly one {text} slot"),
    ("labels: [spam, ham]\nexamples: [{text: hi, label: eggs}]\n", "not one of"),
    ("labels: [spam, ham]\nlabelz: [x]\n", "unknown field"),
    ("labels: [spam, ham]\noverflow: drop\n", "overflow"),
    ("labels: [spam, ham]\nmax_text_tokens: 0\n", "max_text_tokens"),
    ("- a\n- b\n", "mapping at the top level"),
    ("labels: [{name: ' x '}, y]\n", "whitespace"),
])
def test_bad_task_files_fail_clearly(tmp_path, text, match):
    with pytest.raises(TaskSpecError, match=match) as info:
        TaskSpec.from_yaml(_write(tmp_path, text))
    assert "task.yaml" in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TaskSpecError, match="cannot be read"):
        TaskSpec.from_yaml(tmp_path / "nope.yaml")


def test_yaml_is_safe_loaded(tmp_path):
    with pytest.raises(TaskSpecError, match="not valid YAML"):
        TaskSpec.from_yaml(_write(tmp_path, "labels: !!python/object/apply:os.system ['echo hi']\n"))


def test_constructor_and_options():
    task = TaskSpec(instructions="Spam filter.", labels=["spam", {"name": "ham", "description": "fine"}],
                    calibration=True, suffix_template="Message: {text}")
    assert task.labels[1].description == "fine"
    assert task.calibration == DEFAULT_CALIBRATION_TEXTS
    assert task.replace(calibration=False).calibration == ()
