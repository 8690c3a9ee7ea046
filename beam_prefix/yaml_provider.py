"""Kept for users' imports: the code lives in `beam_prefix.beam.yaml_provider`."""

from beam_prefix.beam.yaml_provider import ClassifyText, EmbedText, ExtractFields  # noqa: F401

__all__ = ['ClassifyText', 'EmbedText', 'ExtractFields']
