"""Kept for users' imports: the code lives in `beam_prefix.beam.classify_transform`."""

from beam_prefix.beam.classify_transform import ClassifyText, ClassifyResult  # noqa: F401

__all__ = ['ClassifyText', 'ClassifyResult']
