"""Every gcloud command the docs and templates show parses (#62.2): each is run, offline, by
the gcloud CLI installed here, with no account and no project, and must stop only there, not
at its arguments (gcloud refused `builds submit -f` and `flex-template build --image` beside
`--env FLEX_TEMPLATE_PYTHON_PY_FILE`). Each template has an image of its own, built with its
own entry point."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "templates" / "Dockerfile",
           ROOT / "templates" / "cloudbuild.yaml"]
# what a placeholder stands for when the command runs (as a user would have set them)
VARIABLES = {"IMAGE": "europe-docker.pkg.dev/my-project/beam-prefix/classify:latest",
             "FIT_IMAGE": "europe-docker.pkg.dev/my-project/beam-prefix/fit:latest",
             "EXTRACT_IMAGE": "europe-docker.pkg.dev/my-project/beam-prefix/extract:latest"}
STOPPED_WHERE_EXPECTED = ("You do not currently have an active account selected",
                          "The required property [project] is not currently set")


def gcloud_commands() -> list[tuple[str, str]]:
    """(where, command) of every gcloud command in the sources: in code blocks, and in the
    templates' comment lines, continuation lines joined."""
    found = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        lines = [re.sub(r"^#\s*", "", line) if path.suffix in ("", ".yaml") else line for line in text.splitlines()]
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            if line.startswith("gcloud "):
                command, start = line, i
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command[:-1].rstrip() + " " + lines[i].strip()
                found.append((f"{path.relative_to(ROOT)}:{start + 1}", command))
            i += 1
    return found


def test_every_gcloud_mention_is_a_command_this_test_runs():
    """A gcloud command written in prose (an inline code span across lines) would escape the
    check: every mention is a command line."""
    for path in SOURCES:
        mentions = len(re.findall(r"(?<![\w-])gcloud (builds|dataflow)", path.read_text(encoding="utf-8")))
        commands = [c for where, c in gcloud_commands() if where.startswith(str(path.relative_to(ROOT)) + ":")]
        assert mentions == len(commands), f"{path.name}: {mentions} mentions, {len(commands)} commands"
    assert len(gcloud_commands()) >= 8  # build + template build + run, for each template


@pytest.mark.skipif(shutil.which("gcloud") is None, reason="needs the gcloud CLI")
@pytest.mark.parametrize("where, command", gcloud_commands(), ids=[w for w, _ in gcloud_commands()])
def test_a_documented_gcloud_command_parses(where, command, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("CLOUDSDK_", "GOOGLE_"))}, **VARIABLES,
           "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"), "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
           "GCE_METADATA_HOST": "127.0.0.1:9", "NO_GCE_CHECK": "true"}
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = proc.stderr
    assert proc.returncode != 2 and "unrecognized arguments" not in said and "argument --" not in said, \
        f"{where}: gcloud refused the command itself:\n{said[-2000:]}"
    assert any(s in said for s in STOPPED_WHERE_EXPECTED), f"{where}: {said[-2000:]}"


def test_each_template_is_built_with_its_own_entry_point():
    """One image per template: its build passes the template's launcher, so an image never
    launches another pipeline with this template's parameters."""
    templates = {"metadata.json": "launch.py", "extract_metadata.json": "launch_extract.py",
                 "fit_metadata.json": "launch_fit.py"}
    commands = [c for _, c in gcloud_commands()]
    for metadata, launcher in templates.items():
        builds = [c for c in commands if "flex-template build" in c and f"templates/{metadata}" in c]
        assert builds, metadata
        for build in builds:
            assert "--env" not in build, build  # gcloud refuses --env beside --image
            image = re.search(r'--image "\$(\w+)"', build).group(1)
            images = [c for c in commands if "builds submit" in c and f'_IMAGE="${image}"' in c]
            assert images and all(f"_LAUNCHER={launcher}" in c for c in images), (metadata, images)
    assert not [c for c in commands if "builds submit" in c and " -f " in c]
