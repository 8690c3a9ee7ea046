"""Every code block of the README and the docs runs as written (#56.3).

Each fenced block of ``README.md`` and ``docs/*.md`` is one test, run standalone from the
checkout's root, as a reader would paste it after `make install`:

- ``python``: the block as a script, in a fresh interpreter;
- ``bash``: the block under ``bash -euo pipefail`` (blocks name ``.venv/bin/python`` or a
  ``make`` target themselves);
- ``yaml``: a Beam YAML pipeline (a ``pipeline:`` key) runs with ``apache_beam.yaml.main``;
  any other YAML is a task file and is loaded (`beam_prefix.load_task`);
- ``output``: what the block before it prints: each line shown must be a line of what it
  printed (numbers masked only on lines that report a time or a rate, which vary by
  machine);
- ``text``, ``json`` and unlabelled blocks are shown values, not code.

A block may be marked on the line before it: ``<!-- block: slow -->`` (it runs in `make
test-slow`: the docs pages' blocks, each a real-model run of seconds to minutes; the
README's run in every `make test`) or ``<!-- block: not-run (why) -->`` for one that needs what this machine has
not (a cloud account). The not-run blocks are listed here too (`NOT_RUN`), so the list stays
short and explicit. No block may change a tracked file or leave a file outside the
ignored folders (``output/``): checked around each block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!-- block: (not-run|slow)(?: \((.+?)\))? -->")
CODE = ("python", "bash", "yaml")
SHOWN = ("output", "text", "json", "")
# (page, the block's first line) of every block marked not-run, and why
NOT_RUN = {
    ("README.md", "make test    # the test suite and the docs build (what CI runs)"): "runs this test",
    ("docs/scale.md", "# Dataflow (outputs must be gs://; workers install this package from setup.py, and the "
                      "launcher"): "Dataflow, a Flink cluster",
    ("docs/scale.md", "from beam_prefix import stage_embedded_model"): "a cluster whose workers lack the model",
    ("docs/scale.md", "IMAGE=REGION-docker.pkg.dev/PROJECT/beam-prefix/classify:latest"): "gcloud, Artifact Registry",
    ("docs/scale.md", "FIT_IMAGE=REGION-docker.pkg.dev/PROJECT/beam-prefix/fit:latest"): "gcloud, Dataflow",
    ("docs/extraction.md", "EXTRACT_IMAGE=REGION-docker.pkg.dev/PROJECT/beam-prefix/extract:latest"): "gcloud, Dataflow",
    ("docs/scale.md", ".venv/bin/python -m pipelines.classify --runner=DataflowRunner --device=cuda \\"):
        "Dataflow GPUs",
    ("docs/beam.md", "# Pub/Sub in, BigQuery out: a streaming job on Google Cloud"): "Pub/Sub and BigQuery",
}
TIMING = re.compile(r"\d[\d,.]*\s*(s\b|ms\b|ms/row|rows/s|x\))")
NUMBER = re.compile(r"\d[\d,.]*")


def _blocks():
    """(page, line, language, code, mark, reason) of every fenced block, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            found.append((page.relative_to(ROOT).as_posix(), text.count("\n", 0, m.start()) + 1, m.group(1),
                          m.group(2), mark.group(1) if mark else None, mark.group(2) if mark else None))
    return found


BLOCKS = _blocks()


def _runnable():
    params = []
    for i, (page, line, lang, code, mark, _) in enumerate(BLOCKS):
        if lang not in CODE or mark == "not-run":
            continue
        shown = BLOCKS[i + 1] if i + 1 < len(BLOCKS) and BLOCKS[i + 1][2] == "output" else None
        marks = [pytest.mark.slow] if mark == "slow" else []
        params.append(pytest.param(page, line, lang, code, shown and shown[3], marks=marks, id=f"{page}:{line}"))
    return params


def test_every_block_is_code_or_a_shown_value_and_the_not_run_list_is_explicit():
    marked = {}
    for page, line, lang, code, mark, reason in BLOCKS:
        assert lang in CODE + SHOWN, f"{page}:{line}: block language {lang!r}: use one of {CODE + SHOWN}"
        if mark == "not-run":
            assert reason, f"{page}:{line}: a not-run block says why"
            marked[(page, code.split("\n", 1)[0])] = reason
        if lang == "bash":  # the project's venv, explicitly, and no bracketed optional flags
            assert not re.search(r"(^|[;&|]\s*)python3? ", code, re.M), f"{page}:{line}: use .venv/bin/python"
            assert not re.search(r"\s\[--", code), f"{page}:{line}: a bracketed optional flag is read literally"
    assert set(marked) == set(NOT_RUN), set(marked) ^ set(NOT_RUN)
    assert len(NOT_RUN) <= 8
    for i, (page, line, lang, *_rest) in enumerate(BLOCKS):
        if lang == "output":
            assert i and BLOCKS[i - 1][2] in CODE and BLOCKS[i - 1][4] != "not-run", \
                f"{page}:{line}: an output block follows the block that prints it"


def _tracked_state() -> dict:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    state = {}
    for name in filter(None, listed.decode().split("\0")):
        try:
            state[name] = os.stat(ROOT / name).st_mtime_ns
        except FileNotFoundError:
            state[name] = None
    untracked = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout
    return {"tracked": state, "untracked": set(filter(None, untracked.decode().split("\0")))}


def _run(lang: str, code: str, tmp: Path) -> subprocess.CompletedProcess:
    def run(args, timeout=1500):
        return subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                              text=True, timeout=timeout)

    if lang == "python":
        script = tmp / "block.py"
        script.write_text(code, encoding="utf-8")
        return run([sys.executable, str(script)])
    if lang == "bash":
        return run(["bash", "-euo", "pipefail", "-c", code])
    data = yaml.safe_load(code)
    path = tmp / "block.yaml"
    path.write_text(code, encoding="utf-8")
    if isinstance(data, dict) and "pipeline" in data:
        return run([sys.executable, "-m", "apache_beam.yaml.main", f"--yaml_pipeline_file={path}"])
    return run([sys.executable, "-c", f"from beam_prefix import load_task\nprint(load_task({str(path)!r}).name)\n"],
               timeout=300)


def _matches(shown: str, printed: str) -> bool:
    lines = [line.strip() for line in printed.splitlines()]
    if shown in lines:
        return True
    if TIMING.search(shown):  # a time or a rate: the machine's own numbers
        masked = NUMBER.sub("N", shown)
        return any(NUMBER.sub("N", line) == masked for line in lines)
    return False


@pytest.mark.parametrize("page, line, lang, code, shown", _runnable())
def test_the_block_runs_as_written(page, line, lang, code, shown):
    before = _tracked_state()
    with tempfile.TemporaryDirectory() as tmp:
        done = _run(lang, code, Path(tmp))
    after = _tracked_state()
    printed = done.stdout + done.stderr
    assert done.returncode == 0, f"{page}:{line} exited {done.returncode}:\n{printed[-4000:]}"
    changed = [name for name, mtime in after["tracked"].items() if before["tracked"].get(name) != mtime]
    assert not changed, f"{page}:{line} changed shipped files {changed}"
    left = sorted(after["untracked"] - before["untracked"])
    assert not left, f"{page}:{line} left files outside output/: {left}"
    if shown:
        lines = [s.strip() for s in shown.splitlines() if s.strip()]
        missing = [s for s in lines if not _matches(s, printed)]
        assert not missing, f"{page}:{line} did not print {missing}; it printed:\n{printed[-4000:]}"
