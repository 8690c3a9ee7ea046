"""Kept for users' imports: the code lives in `beam_prefix.beam.extract_transform`."""

from beam_prefix.beam.extract_transform import ExtractFields, extracted_type  # noqa: F401

__all__ = ['ExtractFields', 'extracted_type']
