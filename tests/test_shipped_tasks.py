"""Shipped task names work wherever a task is taken (the library, the transforms, the handler,
Beam YAML, the CLIs), also from an installed package outside this checkout, which installs
nothing under a generic top-level name such as ``pipelines``."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

from beam_prefix import PrefixClassifier, TaskSpec, TaskSpecError, load_task, shipped_tasks
from beam_prefix.beam.classify_transform import ClassifyText
from beam_prefix.beam.embed_transform import EmbedText
from beam_prefix.beam.extract_transform import ExtractFields
from beam_prefix.beam.handler import PrefixCachedModelHandler
from beam_prefix.engines.extractor import Extractor
from beam_prefix.tasks.shipped import resolve_task

from conftest import ROOT, TEXTS

SHIPPED = ROOT / "beam_prefix" / "shipped" / "tasks"
DOCUMENTED = {"support_tickets", "support_tickets_head", "banking77", "banking77_head", "banking77_fast_head",
              "ticket_fields", "ticket_fields_head"}  # the names docs/tasks.md lists


def _same(a, b) -> bool:
    """Two tasks alike, their heads (objects, no equality of their own) by their weights' identity."""
    heads = [getattr(t, "head", None) for t in (a, b)]
    if any(heads):
        plain = "generate" if a.kind == "extract" else "auto"
        return None not in heads and heads[0].identity == heads[1].identity and _same(
            a.replace(head=None, scoring=plain), b.replace(head=None, scoring=plain))
    return a == b


def test_shipped_tasks_lists_every_task_file_the_package_ships():
    assert set(shipped_tasks()) == {p.stem for p in SHIPPED.glob("*.yaml")} >= DOCUMENTED
    for name in shipped_tasks():  # each one loads by its name, as from its file
        by_name, by_path = load_task(name), load_task(str(SHIPPED / f"{name}.yaml"))
        assert _same(by_name, by_path) and by_name.name == name


def test_a_name_is_the_shipped_file_in_every_reader_of_a_task(tiny_dir):
    spec = TaskSpec.from_yaml("support_tickets_head")
    assert spec.head is not None and _same(spec, TaskSpec.from_yaml(SHIPPED / "support_tickets_head.yaml"))
    assert _same(ClassifyText("support_tickets_head").config.task, spec)
    assert _same(ClassifyText(task="support_tickets_head").config.task, spec)
    assert ExtractFields("ticket_fields").config.task == load_task(SHIPPED / "ticket_fields.yaml")
    embed_task = EmbedText("support_tickets", model=tiny_dir).config.task  # (features: no calibration)
    assert embed_task == TaskSpec.from_yaml(SHIPPED / "support_tickets.yaml").replace(calibration=False)
    assert PrefixCachedModelHandler("support_tickets", model=tiny_dir)._task.labels == spec.labels
    served = PrefixCachedModelHandler("ticket_fields_head")._task
    assert served.head.identity == load_task(SHIPPED / "ticket_fields_head.yaml").head.identity
    clf = PrefixClassifier.load("support_tickets", model=tiny_dir, verify=False)
    assert clf.task == TaskSpec.from_yaml(SHIPPED / "support_tickets.yaml")
    assert clf.classify(TEXTS[:2])[0].label in {label.name for label in spec.labels}
    assert Extractor.load("ticket_fields", model=tiny_dir, verify=False).task.kind == "extract"


def test_an_unknown_name_lists_the_shipped_tasks_and_a_path_stays_a_path(tmp_path, monkeypatch):
    with pytest.raises(TaskSpecError, match=r"no shipped task 'suport_tickets'.*did you mean 'support_tickets'"
                                            r".*shipped tasks: banking77, .*ticket_fields"):
        TaskSpec.from_yaml("suport_tickets")
    with pytest.raises(TaskSpecError, match="shipped tasks:"):
        ClassifyText(task="no_such_task")
    own = tmp_path / "support_tickets.yaml"  # a user's file of a shipped name, given as a path
    own.write_text("labels: [yes, no]\ninstructions: Answer.\n", encoding="utf-8")
    assert [label.name for label in TaskSpec.from_yaml(own).labels] == ["yes", "no"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").write_text("labels: [spam, ham]\ninstructions: Answer.\n", encoding="utf-8")
    assert resolve_task("mine") == "mine"  # a bare name that is a local file and no shipped task
    assert resolve_task("./support_tickets.yaml") == "./support_tickets.yaml"
    assert resolve_task("support_tickets") == str(SHIPPED / "support_tickets.yaml")


def test_installed_package_claims_no_top_level_pipelines_and_finds_its_tasks(tmp_path):
    """pip install into a folder of its own, then run from another folder with only that folder
    (not this checkout) on the path: the CLIs under beam_prefix.pipelines, shipped names resolved."""
    source, target = tmp_path / "source", tmp_path / "site"
    # what a clean clone builds from (a checkout's own build/ folder may hold files of older layouts)
    shutil.copytree(ROOT / "beam_prefix", source / "beam_prefix", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, cwd=tmp_path)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))) \
        == ["beam_prefix", "bin"]
    assert sorted(p.name for p in (target / "bin").iterdir()) == [f"beam-prefix-{cli}" for cli in
                                                                 ("classify", "extract", "fit", "tune")]
    for shipped in ("tasks/banking77.head", "data/sample_tickets.parquet", "yaml/classify_tickets.yaml"):
        assert (target / "beam_prefix" / "shipped" / shipped).is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-m", "beam_prefix.pipelines.classify", "--help"], cwd=elsewhere, env=env,
                         check=True, capture_output=True, text=True).stdout
    assert out.startswith("usage: python -m beam_prefix.pipelines.classify")
    assert "--input_table" in out and "--eval_label_column" in out
    probe = ("import importlib.util, beam_prefix\n"
             "from beam_prefix import TaskSpec, load_task, shipped_tasks\n"
             "from beam_prefix.pipelines.options import SAMPLE_TICKETS\n"
             "head = TaskSpec.from_yaml('banking77_head').head\n"
             "from beam_prefix.tasks.shipped import resolve_task\n"
             "print(importlib.util.find_spec('pipelines'), beam_prefix.__file__, SAMPLE_TICKETS, resolve_task('banking77_head'))\n"
             "print(len(head.labels), load_task('ticket_fields').kind, ' '.join(shipped_tasks()))\n")
    lines = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    spec, *paths = lines[0].split()
    assert spec == "None", "an installed beam-prefix must not provide a top-level `pipelines` package"
    assert all(p.startswith(str(target)) for p in paths), paths
    assert lines[1].split(maxsplit=2) == ["77", "extract", " ".join(shipped_tasks())]


def test_the_library_never_imports_the_clis():
    """beam_prefix.{model,tasks,engines,beam} and the top-level modules are the library; the CLIs
    (beam_prefix.pipelines) compose it and are never imported by it, nor is a checkout's pipelines/."""
    package = ROOT / "beam_prefix"
    offenders = []
    for path in package.rglob("*.py"):
        if path.is_relative_to(package / "pipelines"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[0] == "pipelines" or n.startswith("beam_prefix.pipelines")]
    assert offenders == []


def test_every_logger_of_the_clis_is_under_beam_prefix_whose_level_they_set():
    """The CLIs show their progress by setting the ``beam_prefix`` logger to INFO; a logger
    named outside it (as "pipelines" was before the move) would fall silent."""
    import importlib
    import logging
    import pkgutil

    import beam_prefix.pipelines as clis

    for module in pkgutil.iter_modules(clis.__path__):
        importlib.import_module(f"{clis.__name__}.{module.name}")
    names = list(logging.root.manager.loggerDict)
    assert "beam_prefix.pipelines" in names  # (launch's own)
    assert [n for n in names if n.split(".")[0] == "pipelines"] == []
