"""One way a directory enters the local model cache: filled in a temporary sibling folder,
then renamed into place, so a reader sees the whole directory or none of it.

    with filled_in_place(target, marker="model.safetensors", prefix=".convert-") as tmp:
        save_everything_into(tmp)

Used by the GGUF conversion, the copy of a ``gs://`` model directory and the fetch of a
staged embedded model; several processes of one worker may race to fill the same target,
and the loser's rename fails harmlessly where the winner's `marker` file is already there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

__all__ = ["filled_in_place"]


@contextlib.contextmanager
def filled_in_place(target: str, *, marker: str, prefix: str) -> Iterator[str]:
    """Yield a new empty folder beside `target` (named ``<prefix>...``); when the block ends
    without an error, rename it to `target` (atomic). A rename that fails because another
    process already put a complete `target` there (its `marker` file exists) is not an
    error. The temporary folder is removed in every case."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.exists(os.path.join(target, marker)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
