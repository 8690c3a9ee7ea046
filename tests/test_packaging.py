"""A plugin that installs into an existing Beam job (#62.3): every requirement a range whose
lowest end `make test-compat` runs (tests/compat/lowest.txt) and whose newest end `make test`
runs; the Python it names is the one tested; console scripts and a py.typed marker."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

from conftest import ROOT

SETUP = (ROOT / "setup.py").read_text(encoding="utf-8")


def _requirements() -> dict[str, tuple[str, str]]:
    """{name: (lowest, below)} of setup.py's install_requires."""
    block = SETUP[SETUP.index("install_requires=["):SETUP.index("],", SETUP.index("install_requires=["))]
    found = dict(re.findall(r'"([A-Za-z0-9_-]+)>=([\d.]+),<[\d.]+"', block))
    beam = re.search(r'BEAM = "apache-beam\{extras\}>=([\d.]+),<([\d.]+)"', SETUP).groups()
    return {**{name: (low, "") for name, low in found.items()}, "apache-beam": (beam[0], beam[1])}


def test_every_requirement_is_a_range_whose_lowest_end_is_tested():
    lowest = dict(line.split("==") for line in (ROOT / "tests" / "compat" / "lowest.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert not re.search(r'install_requires=\[[^\]]*==', SETUP), "an exact pin in install_requires"
    assert {name: low for name, (low, _) in _requirements().items()} == lowest
    assert "apache-beam[gcp]" not in SETUP[SETUP.index("install_requires"):SETUP.index("extras_require")]
    assert '"gcp": [BEAM.format(extras="[gcp]")]' in SETUP  # the GCP connectors: beam-prefix[gcp]


def test_the_python_it_names_is_the_one_tested():
    assert 'python_requires=">=3.11,<3.12"' in SETUP and sys.version_info[:2] == (3, 11)


def test_console_scripts_and_the_typed_marker():
    scripts = re.search(r'f"beam-prefix-\{cli\}=beam_prefix\.pipelines\.\{cli\}:console_main" for cli in '
                        r'\(([^)]*)\)', SETUP).group(1)
    for cli in re.findall(r'"(\w+)"', scripts):
        assert callable(importlib.import_module(f"beam_prefix.pipelines.{cli}").console_main)
    assert (ROOT / "beam_prefix" / "py.typed").is_file() and '"beam_prefix": ["py.typed"]' in SETUP
    script = os.path.join(os.path.dirname(sys.executable), "beam-prefix-classify")
    if os.path.exists(script):  # (an environment installed from this setup.py: make test's)
        out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "--input_table" in out.stdout
