"""Packaging for Dataflow and Flink: the Flex Template's parameters are exactly the
pipeline's options, and one Beam version everywhere (the installed package itself:
test_shipped_tasks)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from beam_prefix.pipelines.options import ClassifyOptions, StepOptions

from conftest import ROOT

TEMPLATES = ROOT / "templates"


def _parser_actions():
    parser = argparse.ArgumentParser()
    StepOptions._add_argparse_args(parser)
    ClassifyOptions._add_argparse_args(parser)
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def _metadata():
    with open(TEMPLATES / "metadata.json", encoding="utf-8") as f:
        return json.load(f)


def test_metadata_parameters_are_the_pipeline_options_and_back():
    params = {p["name"]: p for p in _metadata()["parameters"]}
    actions = _parser_actions()
    assert set(params) == set(actions), (set(params) ^ set(actions))
    for name, p in params.items():
        assert p["label"] and p["helpText"], name
        assert p["isOptional"] is True, name  # every option has a default or is one of a choice
        assert p["helpText"] == actions[name].help, f"{name}: help text differs from the option's"


def test_extract_metadata_is_the_extract_pipelines_options():
    from beam_prefix.pipelines.extract import ExtractOptions

    parser = argparse.ArgumentParser()
    StepOptions._add_argparse_args(parser)  # the shared flags; classification's are refused
    ExtractOptions._add_argparse_args(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    with open(TEMPLATES / "extract_metadata.json", encoding="utf-8") as f:
        params = {p["name"]: p for p in json.load(f)["parameters"]}
    assert set(params) == set(actions), (set(params) ^ set(actions))
    for name, p in params.items():
        assert p["isOptional"] is True and p["helpText"] == actions[name].help, name
        choices = actions[name].choices
        for choice in choices or ():
            assert any(re.fullmatch(r, str(choice)) for r in p["regexes"]), (name, choice)
    docker = (TEMPLATES / "Dockerfile").read_text(encoding="utf-8")
    assert "ARG LAUNCHER=" in docker and (TEMPLATES / "launch_extract.py").exists()


def test_fit_metadata_is_the_fit_pipelines_options():
    """The fit template (#34.3): its parameters are the flags pipelines.fit reads (the
    row-output flags it refuses are not parameters), with the options' help texts."""
    from beam_prefix.pipelines.fit import NOT_FOR_FIT, FitOptions

    parser = argparse.ArgumentParser()
    StepOptions._add_argparse_args(parser)
    FitOptions._add_argparse_args(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help" and a.dest not in NOT_FOR_FIT}
    with open(TEMPLATES / "fit_metadata.json", encoding="utf-8") as f:
        params = {p["name"]: p for p in json.load(f)["parameters"]}
    assert set(params) == set(actions), (set(params) ^ set(actions))
    for name, p in params.items():  # fit refuses to start without a head file and a label column
        assert p["label"] and p["helpText"] == actions[name].help, name
        assert p["isOptional"] is (name not in ("output", "label_column")), name
        patterns = [re.compile(r) for r in p["regexes"]]
        for choice in actions[name].choices or ():
            assert any(r.fullmatch(str(choice)) for r in patterns), (name, choice)
    assert any(re.fullmatch(r, "-1,12,24") for r in params["layers"]["regexes"])
    assert not any(re.fullmatch(r, "1") for r in params["folds"]["regexes"])  # fit refuses < 2
    assert any(re.fullmatch(r, "banking77_head") for r in params["task"]["regexes"])
    docker = (TEMPLATES / "Dockerfile").read_text(encoding="utf-8")
    assert "ARG LAUNCHER=" in docker and (TEMPLATES / "launch_fit.py").exists()


def test_metadata_regexes_accept_every_choice_and_reject_junk():
    actions = _parser_actions()
    for p in _metadata()["parameters"]:
        patterns = [re.compile(r) for r in p["regexes"]]
        choices = actions[p["name"]].choices
        for choice in choices or ():
            assert any(r.fullmatch(str(choice)) for r in patterns), (p["name"], choice)
        if choices or actions[p["name"]].type is int:
            assert not any(r.fullmatch("not valid!") for r in patterns), p["name"]
    by_name = {p["name"]: [re.compile(r) for r in p["regexes"]] for p in _metadata()["parameters"]}
    assert any(r.fullmatch("my-project:tickets.open_2026") for r in by_name["input_table"])
    assert any(r.fullmatch("gs://bucket/models/qwen") for r in by_name["model"])
    assert not any(r.fullmatch("output/labeled") for r in by_name["output"])  # workers need gs://


def test_one_beam_range_in_setup_dockerfile_and_docs():
    """setup.py's Beam range (#62.3); the image installs its newest end, the version this
    suite runs on, and docs/scale.md states the range."""
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    low, high = re.search(r'BEAM = "apache-beam\{extras\}>=([\d.]+),<([\d.]+)"', setup).groups()
    newest = re.search(r'BEAM_NEWEST = "([\d.]+)"', setup).group(1)
    docker = (TEMPLATES / "Dockerfile").read_text(encoding="utf-8")
    assert set(re.findall(r"ARG BEAM_VERSION=([\d.]+)", docker)) == {newest}
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))
    assert as_tuple(low) <= as_tuple(newest) < as_tuple(high)
    assert f"apache-beam>={low},<{high}" in (ROOT / "docs" / "scale.md").read_text(encoding="utf-8")
    assert "BEAM_LOWEST := " + low in (ROOT / "Makefile").read_text(encoding="utf-8")  # what test-flink runs
    launchers = [p.name for p in TEMPLATES.glob("launch*.py")]
    assert sorted(launchers) == ["launch.py", "launch_extract.py", "launch_fit.py"]
    for launcher in launchers:  # one image per template: LAUNCHER names its entry point
        text = docker.replace("${LAUNCHER}", launcher)
        for source in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        entry = re.search(r'FLEX_TEMPLATE_PYTHON_PY_FILE="\$\{WORKDIR\}/(\S+)"', text).group(1)
        assert entry == f"templates/{launcher}" and (ROOT / entry).exists()


def _template_params(name: str) -> dict:
    with open(TEMPLATES / name, encoding="utf-8") as f:
        return {p["name"]: [re.compile(r) for r in p["regexes"]] for p in json.load(f)["parameters"]}


def _cli_accepts_task(kind: str, value: str) -> bool:
    """What each pipeline's own task check says of a --task value (#56.5)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from beam_prefix import TaskSpec
    from beam_prefix.pipelines.extract import extraction_task
    from beam_prefix.pipelines.options import classify_transform

    try:
        if kind == "extract":
            extraction_task(PipelineOptions([f"--task={value}"]))
        elif kind == "classify":
            classify_transform(PipelineOptions([f"--task={value}"]))
        else:  # the fit template fits classification heads (it requires label_column); an
            # extraction head is fit with the CLI from labelled JSONL (pipelines.fit_extraction)
            TaskSpec.from_yaml(value)
    except ValueError:
        return False
    return True


TEMPLATE_KINDS = {"metadata.json": "classify", "extract_metadata.json": "extract", "fit_metadata.json": "fit"}


@pytest.mark.parametrize("template", list(TEMPLATE_KINDS))
def test_each_template_accepts_the_shipped_tasks_its_cli_accepts_and_no_other(template):
    kind = TEMPLATE_KINDS[template]
    regexes = _template_params(template)["task"]
    from beam_prefix import shipped_tasks

    names = shipped_tasks()  # (test_shipped_tasks: exactly the package's task files)
    assert "ticket_fields" in names and "support_tickets_head" in names
    for name in names:
        by_regex = any(r.fullmatch(name) for r in regexes)
        assert by_regex == _cli_accepts_task(kind, name), (template, name, by_regex)


@pytest.mark.parametrize("template", list(TEMPLATE_KINDS))
def test_each_templates_paths_and_model_agree_with_its_cli_on_dataflow(template, tmp_path):
    """A Flex Template runs its pipeline on Dataflow: its regexes accept the outputs and
    models the CLI accepts there (gs://, embedded, a hub id) and refuse what it refuses there
    (local outputs, a local model directory or .gguf file), both ways."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from beam_prefix.pipelines.options import refuse_local_paths

    params = _template_params(template)
    (tmp_path / "model").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    samples = {"output": ["gs://b/out/labeled", "output/labeled", str(tmp_path / "out")],
               "failed_output": ["gs://b/out/failed", "output/failed"],
               "summary_output": ["gs://b/out/summary.json", "output/summary.json"],
               "model": ["embedded", "gs://b/models/qwen", "Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path / "model"),
                         str(tmp_path / "model.gguf")]}
    flags = ("output", "summary_output") if TEMPLATE_KINDS[template] == "fit" else (
        "output", "failed_output", "summary_output")
    for name, values in samples.items():
        if name not in params:
            continue
        for value in values:
            options = PipelineOptions(["--runner=DataflowRunner", f"--{name}={value}"])
            try:
                refuse_local_paths(options, flags)
                cli = True
            except ValueError:
                cli = False
            assert any(r.fullmatch(value) for r in params[name]) == cli, (template, name, value, cli)


def test_fit_refuses_a_local_output_on_dataflow_before_any_work(tmp_path):
    from beam_prefix.pipelines import fit

    with pytest.raises(ValueError, match="Dataflow workers cannot write"):
        fit.run(["--runner=DataflowRunner", "--label_column=label", f"--output={tmp_path}/h.head",
                 f"--input={ROOT}/pipelines/data/sample_tickets.csv"])
    assert not list(tmp_path.iterdir())
