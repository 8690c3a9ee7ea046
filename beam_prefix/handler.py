"""Kept for users' imports: the code lives in `beam_prefix.beam.handler`."""

from beam_prefix.beam.handler import PrefixCachedModelHandler, KeyedPrefixCachedModelHandler, ServedClassifier, ServedExtractor  # noqa: F401,E501

__all__ = ['PrefixCachedModelHandler', 'KeyedPrefixCachedModelHandler', 'ServedClassifier', 'ServedExtractor']
