"""Prepacked linear layers (`beam_prefix.cpu_linear`): same results as `F.linear`, the
engine exact on them, copies and autograd still working, and `load_model` switching them
on for fp32 CPU models only."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from beam_prefix import PrefixClassifier
from beam_prefix.cpu_linear import PackedLinear, prepack_linears, prepack_works, unpack_linears
from beam_prefix.model import LoadedModel, load_model

from conftest import ARCHS, TEXTS, _tiny, assert_same_predictions, tiny_task

pytestmark = pytest.mark.skipif(not prepack_works(), reason="this torch has no oneDNN packed linear")


def _packed_copy(loaded: LoadedModel) -> LoadedModel:
    model = copy.deepcopy(loaded.model)
    prepack_linears(model.base_model)
    return LoadedModel(model, loaded.tokenizer, loaded.model_id)


def _linears(module) -> list:
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_model_equals_plain_and_stays_exact(tiny_models, arch):
    plain = tiny_models[arch]
    packed = _packed_copy(plain)
    switched = [m for m in packed.model.base_model.modules() if isinstance(m, PackedLinear)]
    # every plain Linear of the base model (GPT-2's Conv1D layers are not Linear: none there)
    assert len(switched) == len([m for m in _linears(plain.model.base_model) if type(m) is torch.nn.Linear])
    assert not isinstance(packed.model.get_output_embeddings(), PackedLinear)  # the head stays as it is
    if arch != "gpt2":
        assert switched
    task = tiny_task()
    ref = PrefixClassifier(task=task, loaded=plain, verify=False, batch_size=3).classify(TEXTS)
    clf = PrefixClassifier(task=task, loaded=packed, verify=True, batch_size=3)
    cached = clf.classify(TEXTS)
    assert_same_predictions(cached, ref)  # packed == plain, within float rounding
    assert_same_predictions(cached, clf.classify_full(TEXTS))  # and cached == full on the packed model


def test_copies_pickles_and_autograd_use_the_weight(tiny_models):
    packed = _packed_copy(tiny_models["llama"]).model
    layer = next(m for m in packed.modules() if isinstance(m, PackedLinear))
    x = torch.randn(2, 3, layer.in_features)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.allclose(layer(x), expected, atol=1e-5)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert "_beam_prefix_packed" not in clone.__dict__  # the opaque copy is never carried over
        with torch.inference_mode():
            assert torch.allclose(clone(x), expected, atol=1e-5)
    # a new weight is packed anew
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    # with autograd the plain path runs, and gradients flow
    x.requires_grad_(True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    # and a model switches back to plain layers
    assert unpack_linears(packed) > 0 and not any(isinstance(m, PackedLinear) for m in packed.modules())


def test_load_model_prepacks_fp32_cpu_models_only(tiny_dir, monkeypatch):
    def count(loaded):
        return sum(isinstance(m, PackedLinear) for m in loaded.model.modules())

    n = len([m for m in _linears(_tiny("llama", 10).base_model) if type(m) is torch.nn.Linear])
    assert count(load_model(tiny_dir)) == n > 0
    assert count(load_model(tiny_dir, prepack=False)) == 0
    assert count(load_model(tiny_dir, dtype="bfloat16")) == 0
    monkeypatch.setenv("BEAM_PREFIX_PREPACK", "0")
    assert count(load_model(tiny_dir)) == 0
