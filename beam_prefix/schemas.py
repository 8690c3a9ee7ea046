"""Kept for users' imports: the code lives in `beam_prefix.beam.schemas`."""

from beam_prefix.beam.schemas import *  # noqa: F401,F403
from beam_prefix.beam.schemas import __all__  # noqa: F401
