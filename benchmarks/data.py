"""Where the benchmarks read and write (the project's data, tasks and results directories),
their rows (the project's CSV files read one way) and the sample tickets cycled to any
number of rows."""

from __future__ import annotations

import csv
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
