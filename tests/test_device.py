"""Devices: every tensor of the engine is made on the model's device, and device flags are
checked where a step is built.

NOTE: no GPU runs these tests. The proof that nothing in the cached path falls back to
torch's default device is to make that default a device no computation can run on
(``meta``): any tensor made without an explicit device lands there and the first
operation mixing it with the model's CPU tensors raises. Under it the whole engine
(first-token, exhaustive and pruned label scoring with calibration, extraction, the
fixed-shape buckets of `suffix_pass="buckets"`, the start-up self-checks and the full
re-encoding references) must run and give the same
results as outside it.
"""

from __future__ import annotations

import apache_beam as beam
import pytest
import torch

from beam_prefix import Extractor, PrefixClassifier
from beam_prefix.errors import ModelLoadError
from beam_prefix.model.loading import check_device, resolve_device

from conftest import BANKING_LABELS, TEXTS, assert_same_predictions, tiny_task
from test_extraction import extract_task


@pytest.fixture
def meta_default():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _engines(loaded):
    return {
        "first_token": PrefixClassifier(task=tiny_task(calibration=True), loaded=loaded),
        "exhaustive": PrefixClassifier(task=tiny_task(BANKING_LABELS, scoring="sequence", calibration=True),
                                       loaded=loaded, label_search="exhaustive"),
        "pruned": PrefixClassifier(task=tiny_task(BANKING_LABELS, scoring="sequence"), loaded=loaded,
                                   label_search="pruned"),
        "extraction": Extractor(task=extract_task(max_new_tokens=24), loaded=loaded),
        # the fixed-shape passes CUDA graphs record (`suffix_graphs`): padding made on the device too
        "first_token buckets": PrefixClassifier(task=tiny_task(calibration=True), loaded=loaded,
                                                suffix_pass="buckets"),
        "exhaustive buckets": PrefixClassifier(task=tiny_task(BANKING_LABELS, scoring="sequence", calibration=True),
                                               loaded=loaded, label_search="exhaustive", suffix_pass="buckets"),
    }


def _run(engine, texts):
    if isinstance(engine, Extractor):
        return engine.extract(texts)
    return engine.classify(texts)


@pytest.mark.parametrize("arch", ["llama", "qwen2_sliding"])
def test_the_whole_engine_makes_every_tensor_on_the_models_device(tiny_models, meta_default, arch):
    texts = TEXTS[:7]
    # built, calibrated and self-checked under the meta default too
    engines = _engines(tiny_models[arch])
    cached = {name: _run(engine, texts) for name, engine in engines.items()}
    assert torch.empty(1).device.type == "meta"  # the default really was meta throughout
    torch.set_default_device(None)  # the references: as any caller would run them
    assert engines["pruned"].label_search == "pruned" and engines["first_token"].mode == "first_token"
    for name, engine in engines.items():
        if isinstance(engine, Extractor):
            full = engine.extract_full(texts)
            assert [c.tokens for c in cached[name]] == [f.tokens for f in full], name
        elif name == "pruned":  # exact to its tolerance in probability (an unexpanded label's
            # log-probability is its bound's share): against exhaustive scoring
            assert_same_predictions(cached[name], engine.classify_exhaustive(texts), log_atol=float("inf"))
        else:
            assert_same_predictions(cached[name], engine.classify_full(texts))
        if not isinstance(engine, Extractor):  # and the same as the same engine outside meta
            assert_same_predictions(cached[name], _run(engine, texts), atol=1e-6)


def test_device_flags_are_checked_where_the_step_is_built(tiny_dir):
    from beam_prefix.beam.extract_transform import ExtractFields
    from beam_prefix.beam.classify_transform import ClassifyText

    for device in ("cpu", "auto", "cuda", "cuda:1"):
        check_device(device)
    for bad in ("gpu", "cuda:x", "CPU", ""):
        with pytest.raises(ValueError, match="device must be one of cpu, cuda, cuda:N, auto"):
            check_device(bad)
        with pytest.raises(ValueError, match="device must be one of"):
            ClassifyText(task=tiny_task(), model=tiny_dir, device=bad)
    with pytest.raises(ValueError, match="float16 is for GPUs"):
        ExtractFields(task=extract_task(), model=tiny_dir, dtype="float16")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_step_on_a_machine_without_one_fails_loudly(tiny_dir):
    from beam_prefix.beam.classify_transform import ClassifyText

    with pytest.raises(Exception, match="no CUDA device here"):
        with beam.Pipeline() as p:
            _ = p | beam.Create([{"text": "app crashes"}]) | ClassifyText(task=tiny_task(), model=tiny_dir,
                                                                          device="cuda", verify=False)
    with pytest.raises(ModelLoadError, match="no CUDA device here"):
        PrefixClassifier.load(tiny_task(), tiny_dir, device="cuda:0")
