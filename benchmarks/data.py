"""Where the benchmarks read and write (the project's data, tasks and results directories),
their rows (the project's CSV files read one way), the sample tickets cycled to any
number of rows, and a report written as ``<name>.json`` beside ``<name>.md``."""

from __future__ import annotations

import csv
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "pipelines", "data")
TASKS = os.path.join(ROOT, "pipelines", "tasks")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def csv_rows(path: str, text: str = "text", label: str = "label") -> list[tuple[str, str]]:
    """(text, label) of every row of a CSV file."""
    with open(path, newline="", encoding="utf-8") as f:
        return [(r[text], r[label]) for r in csv.DictReader(f)]


def sample_tickets(rows: int) -> list[str]:
    """`rows` texts: the 60 sample tickets, cycled."""
    tickets = [t for t, _ in csv_rows(os.path.join(DATA, "sample_tickets.csv"))]
    return [tickets[i % len(tickets)] for i in range(rows)]


def write_results(out_dir: str, name: str, report: dict, markdown: str, *, indent: int = 1) -> None:
    """`report` as ``<name>.json`` and `markdown` as ``<name>.md`` under `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=indent)
    with open(os.path.join(out_dir, f"{name}.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
