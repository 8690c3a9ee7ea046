"""Where `pipelines.fit` stages its features, and how it writes the head: on the output's
own file system (a local folder, ``gs://`` or any Beam FileSystem), so that workers on
other machines can deliver the features and classify can read the head where fit put it.

The features go to a hidden folder beside the head, ``.beam-prefix-fit-<head name>-<run>/``
(one Parquet file per worker shard and a count of failed rows), are read back by the
launcher, and the folder is deleted when the fit ends, also when it fails. A fit killed
outright (kill -9) cannot clean up: the next fit of the same head file removes what such a
run left. The head is written to a temporary name beside its final one and renamed into
place, so a reader never sees half a head.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from beam_prefix.pipelines.paths import RUN_TAG, entries, is_local, join, matches, new_run_tag, split

__all__ = ["FeatureStaging", "write_head", "STAGING_PREFIX"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.fit")
STAGING_PREFIX = ".beam-prefix-fit-"


def _split(path: str) -> tuple[str, str]:
    return split(path if not is_local(path) else os.path.abspath(path))


def _read(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


class FeatureStaging:
    """The staging folder of one fit, beside the head file `output`.

    Args:
        output: the head file's path (local or a Beam FileSystem URL).
    """

    def __init__(self, output: str):
        self.directory, self.name = _split(output)
        self._prefix = f"{STAGING_PREFIX}{self.name}-"
        self.path = join(self.directory, f"{self._prefix}{new_run_tag()}")

    def prepare(self) -> None:
        """Create the head's folder if missing (as classify does for its outputs) and
        remove what an earlier fit of the same head that was killed left behind."""
        if is_local(self.directory):
            os.makedirs(self.directory, exist_ok=True)
        # (exactly this head's: a fit of head "a" never removes the staging of a fit of "a-b")
        ours = re.compile(re.escape(self._prefix) + RUN_TAG)
        for folder in entries(self.directory, self._prefix + "*"):
            if ours.fullmatch(split(folder)[1]) and folder != self.path:
                _LOGGER.info("removing %s, left by an earlier fit of %s that did not finish", folder, self.name)
                self._delete(folder)

    def features_of(self, dtype: str) -> str:
        """The features' file prefix in one precision (a Parquet sink writes
        ``features_<dtype>-*.parquet``)."""
        return join(self.path, f"features_{dtype}")

    def label_rows_of(self, dtype: str) -> str:
        """The task's label rows' features' file prefix in one precision."""
        return join(self.path, f"label_rows_{dtype}")

    @property
    def failed(self) -> str:
        """The failed-row count's file prefix (a text sink)."""
        return join(self.path, "failed")

    def read_features(self, dtype: str) -> pa.Table:
        """The staged features in one precision (one table)."""
        return self._table(self.features_of(dtype))

    def failed_count(self) -> int:
        """The number of failed rows."""
        return sum(int(_read(p).decode("ascii").strip() or 0) for p in matches(self.failed + "*"))

    def read_label_rows(self, dtype: str) -> pa.Table | None:
        """The staged features of the task's label rows in one precision (one table; None:
        none staged)."""
        prefix = self.label_rows_of(dtype)
        return self._table(prefix) if matches(prefix + "*") else None

    @staticmethod
    def _table(prefix: str) -> pa.Table:
        return pa.concat_tables([pq.read_table(io.BytesIO(_read(p))) for p in sorted(matches(prefix + "*"))])

    def delete(self) -> None:
        self._delete(self.path)

    @staticmethod
    def _delete(folder: str) -> None:
        try:
            if is_local(folder):
                shutil.rmtree(folder, ignore_errors=True)
            else:  # object stores have no folders: delete what lies under the name
                files = matches(folder + "/**")
                if files:
                    FileSystems.delete(files)
        except Exception as e:  # noqa: BLE001 - cleanup must not hide the fit's own result or error
            _LOGGER.warning("could not remove the staging folder %s: %s", folder, e)


def write_head(head, output: str) -> None:
    """Write `head` (a `TrainedHead`) to `output`, all or nothing: a temporary file beside
    it, then a rename."""
    directory, name = _split(output)
    tmp = join(directory, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    if is_local(output):
        try:
            head.save(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, output)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as local:
        path = os.path.join(local, "head")
        head.save(path)
        with open(path, "rb") as src, FileSystems.create(tmp) as dst:
            dst.write(src.read())
    try:
        if FileSystems.exists(output):
            FileSystems.delete([output])
        FileSystems.rename([tmp], [output])
    finally:
        if FileSystems.exists(tmp):
            FileSystems.delete([tmp])
