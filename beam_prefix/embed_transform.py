"""Kept for users' imports: the code lives in `beam_prefix.beam.embed_transform`."""

from beam_prefix.beam.embed_transform import EmbedText  # noqa: F401

__all__ = ['EmbedText']
