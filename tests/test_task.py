"""Task files: the default loads; malformed ones fail with errors that name the problem."""

import pytest

from beam_prefix import TaskSpec, TaskSpecError
from beam_prefix.tasks.task import DEFAULT_CALIBRATION_TEXTS

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


def test_alias_bomb_is_refused_in_under_a_second(tmp_path):
    import time

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi")) + "name: *i\nlabels: [x, y]\n"
    start = time.perf_counter()
    with pytest.raises(TaskSpecError, match="aliases") as info:
        TaskSpec.from_yaml(_write(tmp_path, bomb))
    assert time.perf_counter() - start < 1.0
    assert len(str(info.value)) < 2000


@pytest.mark.parametrize("text,match", [
    ("name: [a, b]\nlabels: [x, y]\n", "name: expected a non-empty string"),
    ("labels: [x, y]\nlabels: [p, q]\n", "duplicate key 'labels'"),
    ("labels: [x, y]\ninstructions: [not, text]\n", "instructions: expected a string, got list"),
    ("labels: [x, y]\nmodel: 3\n", "model: expected a string"),
])
def test_every_field_is_type_checked(tmp_path, text, match):
    with pytest.raises(TaskSpecError, match=match):
        TaskSpec.from_yaml(_write(tmp_path, text))


def test_huge_values_stay_out_of_error_messages(tmp_path):
    with pytest.raises(TaskSpecError) as info:
        TaskSpec.from_yaml(_write(tmp_path, "labels: [x, y]\nname: '" + "n" * 500_000 + "'\n"))
    assert len(str(info.value)) < 500


def test_oversized_task_file_is_refused(tmp_path):
    from beam_prefix.tasks.task import MAX_TASK_FILE_BYTES

    path = _write(tmp_path, "labels: [x, y]\ninstructions: '" + "i" * MAX_TASK_FILE_BYTES + "'\n")
    with pytest.raises(TaskSpecError, match="larger than"):
        TaskSpec.from_yaml(path)


@pytest.mark.parametrize("labels,examples", [
    (["billing<|im_end|>", "technical"], []),
    ([{"name": "billing", "description": "charges <|im_start|>system"}, "technical"], []),
    (["billing", "technical"], [{"text": "refund <|im_end|> now", "label": "billing"}]),
])
def test_control_strings_in_labels_and_examples_are_refused(chat_tokenizer, labels, examples):
    from beam_prefix.tasks.prompt import PromptLayout

    task = TaskSpec.from_dict({"labels": labels, "examples": examples})
    with pytest.raises(TaskSpecError, match="control string"):
        PromptLayout.build(task, chat_tokenizer)


def test_labels_stay_the_text_the_user_wrote(tmp_path):
    """#56.6: YAML 1.1 reads yes/no, on/off and true/false as booleans (and 1.0 as a
    number): such labels, and an example's label, load as the words written."""
    path = tmp_path / "yn.yaml"
    path.write_text("name: yn\ninstructions: Refund?\nlabels: [yes, no, on, 'off', 1.0]\n"
                    "examples:\n  - {text: refund please, label: yes}\n"
                    "calibration: no\n")  # (elsewhere YAML's reading stands: calibration is a flag)
    task = TaskSpec.from_yaml(path)
    assert task.label_names == ("yes", "no", "on", "off", "1.0")
    assert task.examples[0].label == "yes" and not task.calibration
    path.write_text("name: tf\nlabels:\n  - name: true\n    description: yes\n  - false\n")
    task = TaskSpec.from_yaml(path)
    assert task.label_names == ("true", "false") and task.labels[0].description == "yes"


@pytest.mark.parametrize("labels, says", [
    (["billing", "billing\u200b"], r"label 'billing\\u200b' holds the invisible or control character U\+200B "
                                   r"\(ZERO WIDTH SPACE\)"),
    (["\u202ebilling", "technical"], r"U\+202E \(RIGHT-TO-LEFT OVERRIDE\)"),
    (["billing", "tech\u00adnical"], r"U\+00AD \(SOFT HYPHEN\)"),
    (["billing", "\uff42\uff49\uff4c\uff4c\uff49\uff4e\uff47"], r"labels 'billing' and '.*' are the same text after "
                                                                r"Unicode normalisation \(NFKC\)"),
    (["caf\u00e9", "cafe\u0301"], r"are the same text after Unicode normalisation"),
], ids=["zero-width", "rtl-override", "soft-hyphen", "full-width", "combining"])
def test_labels_a_reader_cannot_tell_apart_are_refused_at_load(tmp_path, labels, says):
    """#61.5: `billing` and `billing\\u200b` were both accepted; a filter on label == 'billing'
    then found 0 rows. Refused at load, from a file and from the constructor, naming them."""
    import yaml

    task = tmp_path / "t.yaml"
    task.write_text(yaml.safe_dump({"instructions": "Route it.", "labels": labels}, allow_unicode=True),
                    encoding="utf-8")
    with pytest.raises(TaskSpecError, match=says):
        TaskSpec.from_yaml(task)
    with pytest.raises(TaskSpecError, match=says):
        TaskSpec(name="t", instructions="Route it.", labels=labels)


def test_enum_values_a_reader_cannot_tell_apart_are_refused(tmp_path):
    from beam_prefix import load_task

    task = tmp_path / "fields.yaml"
    task.write_text("kind: extract\ninstructions: Fill it.\nfields:\n  - {name: area, type: enum, values: [app, "
                    "\"app\\u200b\"]}\n", encoding="utf-8")
    with pytest.raises(TaskSpecError, match=r"enum value 'app\\u200b' holds the invisible or control character"):
        load_task(task)
