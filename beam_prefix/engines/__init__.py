"""The engine floor: answering rows over a cached prompt.

`prefix_engine` holds the lifecycle every engine shares (load, prompt build, the start-up
self-check, per-thread forks, the batch loop); `classifier` classifies with one of the
`label_scorers` (first token, label trie, pruned trie search in `label_search`, a trained
head) and answers with the records of `predictions`; `extractor` extracts fields by greedy
`decoding` constrained to the task's JSON schema (`constraints`). `head_fitting` fits trained heads and `model_tuning` tunes the
model's layers for them, both through the same forward. Imports the task and model floors only; knows nothing of Beam.
"""

from beam_prefix.engines.classifier import PrefixClassifier
from beam_prefix.engines.predictions import Embedding, Prediction
from beam_prefix.engines.extractor import Extraction, Extractor
from beam_prefix.engines.head_fitting import fit_head
from beam_prefix.engines.model_tuning import tune_model
from beam_prefix.engines.prefix_engine import PrefixEngine

__all__ = ["PrefixEngine", "PrefixClassifier", "Prediction", "Embedding", "Extractor", "Extraction", "fit_head", "tune_model"]
