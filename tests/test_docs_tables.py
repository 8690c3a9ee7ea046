"""The accuracy and cost tables of the README and the docs are one benchmark run's
(#55.3, #56.1): the rows between ``<!-- table: NAME -->`` and ``<!-- end table -->`` are
what `benchmarks.baselines.table_rows` makes of ``benchmarks/results/NAME.json``, and the
chart beside them is that run's."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import baselines

from conftest import ROOT

TABLE = re.compile(r"<!-- table: (\w+) -->\n(.*?)<!-- end table -->", re.S)
PAGES = {"README.md": True, "docs/accuracy-cost.md": False}  # page -> brief


@pytest.mark.parametrize("page", list(PAGES))
def test_the_tables_are_the_benchmark_runs(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    tables = TABLE.findall(text)
    assert tables, f"{page} has no benchmark table"
    for name, body in tables:
        report = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text(encoding="utf-8"))
        rows = [line for line in body.strip().splitlines() if line.startswith("|")][2:]  # past the header
        assert rows == baselines.table_rows(report, brief=PAGES[page]), f"{page}: table {name} is not its run's"


def test_the_chart_is_drawn_from_a_report(tmp_path):
    report = json.loads((ROOT / "benchmarks" / "results" / "baselines_defaults.json").read_text(encoding="utf-8"))
    baselines.chart(report, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "assets" / "accuracy_cost.png").exists()


def test_the_extraction_tables_are_the_benchmark_run():
    """docs/extraction.md's SNIPS, anchor and ticket tables are `make bench-extraction`'s run."""
    from benchmarks import extraction_heads

    text = (ROOT / "docs" / "extraction.md").read_text(encoding="utf-8")
    found = dict(TABLE.findall(text))
    assert "extraction_heads" in found, "docs/extraction.md has no extraction_heads table"
    report = json.loads((ROOT / "benchmarks" / "results" / "extraction_heads.json").read_text(encoding="utf-8"))
    rows = [line for line in found["extraction_heads"].splitlines() if line.startswith("|")]
    assert rows == [line for line in extraction_heads._markdown(report).splitlines() if line.startswith("|")]
