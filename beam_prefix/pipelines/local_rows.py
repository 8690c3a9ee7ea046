"""Columns of local input files read in this process, without a Beam pipeline.

What a launch reads before any model work (`pipelines.fit` checks its label column) and what
`pipelines.tune` trains on: CSV, JSON Lines or Parquet files matching a local pattern, the
same formats the pipelines read (`pipelines.sources`). A JSON line that does not parse
is None instead of a tuple (in a pipeline it is a failed row); the caller says what it and
a missing value mean.
"""

from __future__ import annotations

import csv
import glob
import json
from typing import Sequence

import pyarrow.parquet as pq

from beam_prefix.pipelines.paths import regular_files

__all__ = ["local_paths", "local_columns"]


def local_paths(pattern: str, flag: str = "--input") -> list[str]:
    """The local files `pattern` matches, sorted (none for a ``scheme://`` pattern).

    Raises:
        ValueError: a match that is not a regular file (`paths.regular_files`).
    """
    return regular_files(sorted(glob.glob(pattern)), flag) if "://" not in pattern else []


def local_columns(paths: Sequence[str], fmt: str, columns: Sequence[str]) -> list[tuple | None]:
    """One tuple per row of `paths` (in order), the values of `columns` (None when absent);
    None for a JSON line that does not parse."""
    rows: list[tuple | None] = []
    for path in paths:
        if fmt == "parquet":
            table = pq.read_table(path)
            present = [table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows
                       for c in columns]
            rows += list(zip(*present)) if columns else [()] * table.num_rows
            continue
        with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
            if fmt == "csv":
                rows += [tuple(row.get(c) for c in columns) for row in csv.DictReader(f)]
                continue
            for line in f:
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    rows.append(tuple(data.get(c) for c in columns))
                except (ValueError, AttributeError, RecursionError):
                    rows.append(None)
    return rows
