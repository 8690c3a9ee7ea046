"""The README's code blocks, as written (#34.6).

- every ``python`` block is executed on the embedded model (``slow``: `make test-slow`), in a folder where the README's
  relative paths resolve; the names a block takes from its surrounding prose (``texts``,
  ``rows``, a pipeline ``p``, ...) are given to it first (`CONTEXT`), and a Beam block's
  pipeline is run, except the one the README marks "on paper" (Pub/Sub and BigQuery: no such
  service here), whose graph is built;
- every ``yaml`` block is loaded as a task file;
- every ``bash`` command is checked against what it names: a ``python -m pipelines.*``
  command's flags are parsed by that pipeline's own flag check (what ``--help`` lists), a
  ``make`` target exists, a YAML pipeline's file exists and gets every variable it uses, a
  ``gcloud`` command's files exist. Bash blocks are not run (Dataflow, Flink, gcloud);
  ``make demo`` runs in the end-to-end pipeline tests, the YAML pipelines in test_yaml.

Unlabelled blocks are sample outputs, not code.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    README = f.read()

BLOCKS = [(m.group(1), m.group(2), README.count("\n", 0, m.start()) + 1)
          for m in re.finditer(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)]

TEXTS = ["I was charged twice for my March invoice.", "The app crashes when I open settings.",
         "How do I reset my password?"]

_ROWS = ("rows = p | beam.Create([{'id': 'T1', 'ticket_id': 'T1', 'tenant': 'acme', 'text': 'I was charged twice'},"
         " {'id': 'T2', 'ticket_id': 'T2', 'tenant': 'globex', 'text': 'The app crashes on start'}])\n")
_PIPELINE = ("import apache_beam as beam\nfrom beam_prefix.transforms import ClassifyText\n"
             "from beam_prefix.extract_transform import ExtractFields\np = beam.Pipeline()\n" + _ROWS)
_RUN = "\np.run().wait_until_finish()\n"

# a distinctive line of a python block -> (what its prose gives it, what follows it)
CONTEXT = {
    'clf = PrefixClassifier.load(task, model="embedded")': (f"texts = {TEXTS!r}\n", ""),
    "head = fit_head(base, texts, labels": (
        "import csv\nrows = list(csv.DictReader(open('pipelines/data/sample_tickets.csv')))[:12]\n"
        "texts, labels = [r['text'] for r in rows], [r['label'] for r in rows]\n",
        "\nassert PrefixClassifier(task=task, loaded=base.loaded).classify(texts[:2])[0].label in labels\n"),
    "with beam.Pipeline() as p:": ("", ""),
    "labeled = rows | ClassifyText(": (_PIPELINE, _RUN),
    "beam.io.ReadFromPubSub": (_PIPELINE + "SUB = 'projects/my-project/subscriptions/tickets'\n", ""),  # on paper: built only
    '"ByDir" >> ClassifyText(tasks="tasks/", task_column="tenant")': (
        _PIPELINE + "from beam_prefix import TaskSpec\n"
        "acme_spec = TaskSpec.from_yaml('tasks/acme.yaml')\n", _RUN),
    'ex = Extractor.load("pipelines/tasks/ticket_fields.yaml"': (f"texts = {TEXTS[:1]!r}\n", ""),
    "result = rows | ExtractFields(": (_PIPELINE, _RUN),
}


def _python_blocks():
    return [(line, code) for lang, code, line in BLOCKS if lang == "python"]


def test_every_python_block_has_its_context():
    """A new python block in the README gets its context here (or runs as it is)."""
    for line, code in _python_blocks():
        assert sum(key in code for key in CONTEXT) == 1, f"README line {line}: no CONTEXT entry for this block"


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory):
    """A folder where the README's relative paths resolve: the repository's pipelines/, a
    tasks/ folder of two tasks, a globex.yaml (the routing block's) and a support_tickets.yaml."""
    import shutil

    d = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(ROOT, "pipelines"), d / "pipelines")
    (d / "tasks").mkdir()
    support = os.path.join(ROOT, "pipelines", "tasks", "support_tickets.yaml")
    for name in ("tasks/acme.yaml", "tasks/globex.yaml", "globex.yaml", "support_tickets.yaml"):
        shutil.copy(support, d / name)
    return d


# each block loads the embedded model, builds its prefix and self-checks it (20-60 s a block
# on 2 cores): `make test-slow` runs them; the default run checks that each has its context
@pytest.mark.slow
@pytest.mark.parametrize("line,code", _python_blocks(), ids=[f"line{line}" for line, _ in _python_blocks()])
def test_python_block_runs_as_written(readme_dir, monkeypatch, line, code):
    before, after = next(v for k, v in CONTEXT.items() if k in code)
    monkeypatch.chdir(readme_dir)
    import apache_beam as beam

    class WriteToBigQuery(beam.PTransform):
        """Beam's own expands through a Java expansion service it downloads (no network
        here): this checks the table reference with Beam's parser and writes nowhere."""

        def __init__(self, table, **kwargs):
            from apache_beam.io.gcp.bigquery_tools import parse_table_reference

            super().__init__()
            parse_table_reference(table)

        def expand(self, rows):
            return rows | beam.Map(lambda row: row)

    monkeypatch.setattr(beam.io, "WriteToBigQuery", WriteToBigQuery)
    exec(compile(before + code + after, f"README.md:{line}", "exec"), {"__name__": "readme"})


def test_every_yaml_block_is_a_task_file_that_loads(tmp_path):
    from beam_prefix import load_task

    blocks = [(line, code) for lang, code, line in BLOCKS if lang == "yaml"]
    assert blocks
    for line, code in blocks:
        path = tmp_path / f"line{line}.yaml"
        path.write_text(code.replace("model: embedded", ""), encoding="utf-8")
        load_task(str(path))


def _commands():
    """Each bash command as words: continuation lines joined, comments dropped, a quoted
    argument spanning lines kept whole, `[--x]` read as `--x`, `...` dropped."""
    out = []
    for lang, code, line in BLOCKS:
        if lang != "bash":
            continue
        pending = ""
        for text in re.sub(r"\\\n", " ", code).splitlines():
            text = pending + " " + re.sub(r"(^|\s)#.*$", "", text) if pending else re.sub(r"(^|\s)#.*$", "", text)
            try:
                words = shlex.split(text.replace("[", "").replace("]", ""))
            except ValueError:  # an open quote: the argument goes on on the next line
                pending = text
                continue
            pending = ""
            if words:
                out.append((line, text.strip(), [w for w in words if w != "..."]))
        assert not pending, f"README.md:{line}: unbalanced quotes"
    return out


def _check_pipeline_flags(module: str, argv: list[str]) -> None:
    from pipelines.extract import ExtractOptions
    from pipelines.fit import FitOptions
    from pipelines.options import ClassifyOptions, StepOptions, join_negative_lists, refuse_unknown_flags

    if module == "tune":  # its own parser (it runs in this process, not as a Beam pipeline)
        from pipelines.tune import parser

        _, unknown = parser().parse_known_args(join_negative_lists(argv, ("--layers",)))
        if unknown:
            raise ValueError(f"python -m pipelines.tune: unknown flags {unknown}")
        return
    own = {"classify": (StepOptions, ClassifyOptions), "extract": (StepOptions, ExtractOptions),
           "fit": (StepOptions, FitOptions)}[module]
    refuse_unknown_flags(join_negative_lists(argv, ("--layers",)), own, f"python -m pipelines.{module}")


def test_every_bash_command_names_flags_files_and_targets_that_exist():
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        targets = set(re.findall(r"^([\w-]+):", f.read(), flags=re.M))
    kinds = set()
    for line, text, words in _commands():
        where = f"README.md:{line}: {text[:80]}"
        if words[0] == "make":
            assert words[1] in targets, where
            kinds.add("make")
        elif words[:2] == ["python", "-m"] and words[2].startswith("pipelines."):
            if "--help" not in words:
                _check_pipeline_flags(words[2].split(".")[1], words[3:])
            kinds.add("pipelines")
        elif words[:3] == ["python", "-m", "apache_beam.yaml.main"]:
            import json

            flags = dict(w.split("=", 1) for w in words[3:])
            with open(os.path.join(ROOT, flags["--yaml_pipeline_file"]), encoding="utf-8") as f:
                used = set(re.findall(r"{{\s*(\w+)", f.read()))
            given = set(json.loads(flags["--jinja_variables"]))
            assert used - {"layers"} <= given, (where, used - given)  # layers has a default
            kinds.add("yaml")
        elif words[0] == "gcloud":
            for flag in ("-f", "--metadata-file"):
                if flag in words:
                    assert os.path.isfile(os.path.join(ROOT, words[words.index(flag) + 1])), where
            kinds.add("gcloud")
        elif re.match(r"^\w+=", words[0]):  # a shell variable for the commands after it
            continue
        else:
            raise AssertionError(f"{where}: a kind of command this test does not check yet")
    assert kinds == {"make", "pipelines", "yaml", "gcloud"}


def test_a_misspelt_flag_in_a_readme_command_would_fail_this_check():
    with pytest.raises(ValueError, match="did you mean --eval_label_column"):
        _check_pipeline_flags("classify", ["--eval_label_colum", "label"])
    with pytest.raises(ValueError, match="unknown flags"):
        _check_pipeline_flags("tune", ["--input=x.csv", "--label_column=y", "--output=z", "--epoch=2"])
