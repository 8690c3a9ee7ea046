"""Prepacked linear layers (`beam_prefix.model.cpu_linear`): same results as `F.linear`, the
engine exact on them, copies and autograd still working, and `load_model` switching them
on for fp32 CPU models only; siblings (linears on one input) computed as one GEMM, with
the same results, whatever the call order, thread or failure."""

from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch

from beam_prefix import PrefixClassifier
from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.cpu_linear import (_GROUP, PackedLinear, _thread_slots, fuse_siblings, prepack_linears,
                                    prepack_works, unpack_linears)
from beam_prefix.model.loading import LoadedModel, load_model

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


def _grouped_copy(loaded: LoadedModel) -> tuple[LoadedModel, int]:
    packed = _packed_copy(loaded)
    return packed, fuse_siblings(packed.model.base_model, packed.model.config.vocab_size)


def _members(module) -> list:
    return [m for m in module.modules() if _GROUP in m.__dict__]


@pytest.mark.parametrize("arch", ARCHS)
def test_siblings_run_as_one_gemm_and_stay_exact(tiny_models, arch):
    plain = tiny_models[arch]
    grouped, groups = _grouped_copy(plain)
    layers = plain.model.config.num_hidden_layers
    # q/k/v and gate/up of every layer (GPT-2's fused Conv1D layers are not Linear: none)
    assert groups == (0 if arch == "gpt2" else 2 * layers)
    assert len(_members(grouped.model)) == (0 if arch == "gpt2" else 5 * layers)
    if arch == "gpt2":
        return  # nothing grouped: the packed test above covers it
    task = tiny_task()
    ref = PrefixClassifier(task=task, loaded=plain, verify=False, batch_size=3).classify(TEXTS)
    for batch, engine in ((1, "auto"), (3, "auto"), (3, "expanded")):
        clf = PrefixClassifier(task=task, loaded=grouped, verify=True, batch_size=batch, prefix_attention=engine)
        cached = clf.classify(TEXTS)
        assert_same_predictions(cached, ref)  # grouped == plain, within float rounding
        assert_same_predictions(cached, clf.classify_full(TEXTS))
    # generation too: the same tokens as re-encoding every prompt
    from test_extraction import _tokens, extract_task

    ex = Extractor(task=extract_task(), loaded=grouped, batch_size=3)
    assert _tokens(ex.extract(TEXTS[:6])) == _tokens(ex.extract_full(TEXTS[:6]))
    assert not _thread_slots()  # nothing of a call waits in this thread


def test_a_member_called_alone_or_out_of_order_computes_its_own_output(tiny_models):
    grouped, _ = _grouped_copy(tiny_models["qwen2_sliding"])  # q/k/v with biases
    attn = grouped.model.base_model.layers[0].self_attn
    x, other = torch.randn(2, 3, attn.q_proj.in_features), torch.randn(2, 3, attn.q_proj.in_features)

    def ref(layer, inp):
        return torch.nn.functional.linear(inp, layer.weight, layer.bias)

    with torch.inference_mode():
        for order in ((attn.v_proj, attn.q_proj, attn.k_proj), (attn.k_proj, attn.k_proj, attn.q_proj)):
            for layer in order:
                assert torch.allclose(layer(x), ref(layer, x), atol=1e-5)
                assert torch.allclose(attn.k_proj(other), ref(attn.k_proj, other), atol=1e-5)  # another input
        _thread_slots().clear()
        attn.q_proj(x)  # k and v's parts wait for them ...
        assert _thread_slots()
        grouped.model.base_model(input_ids=torch.tensor([[1, 2, 3]]))
        assert not _thread_slots()  # ... until the model's forward ends
        attn.q_proj(x)
        boom = grouped.model.base_model.layers[1].mlp.register_forward_pre_hook(_raise)
        with pytest.raises(RuntimeError, match="boom"):
            grouped.model.base_model(input_ids=torch.tensor([[1, 2, 3]]))
        boom.remove()
        assert not _thread_slots()  # also when it raises


def _raise(*_):
    raise RuntimeError("boom")


def test_threads_share_the_groups_and_copies_compute_alone(tiny_models):
    import threading

    # a model of its own: the session's tiny Llama may have returned hidden states already,
    # for which transformers hooked it with closures that do not pickle (whichever test ran first)
    tok = tiny_models["llama"].tokenizer
    grouped, _ = _grouped_copy(LoadedModel(_tiny("llama", len(tok)), tok, "tiny-llama"))
    base = grouped.model.base_model
    inputs = [torch.randint(1, 50, (1, 7 + i)) for i in range(8)]
    with torch.inference_mode():
        expected = [base(input_ids=ids).last_hidden_state for ids in inputs]
    results, errors = {}, []

    def run(i):
        try:
            with torch.inference_mode():
                for _ in range(20):
                    results[i] = base(input_ids=inputs[i]).last_hidden_state
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, e in enumerate(expected):
        assert torch.equal(results[i], e)
    for clone in (copy.deepcopy(grouped.model), pickle.loads(pickle.dumps(grouped.model))):
        assert not _members(clone)
        with torch.inference_mode():
            assert torch.allclose(clone.base_model(input_ids=inputs[0]).last_hidden_state, expected[0], atol=1e-5)
    assert unpack_linears(grouped.model) and not _members(grouped.model)


class _WritesIntoItsInput(torch.nn.Module):
    """Two linears on one input, with the input changed in place between their calls:
    the grouped result would be wrong for the second."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        first = self.a(x)
        x.mul_(2)
        return types.SimpleNamespace(last_hidden_state=torch.cat([first, self.b(x)], -1))


def test_a_grouping_that_changes_the_output_is_undone():
    model = _WritesIntoItsInput()
    assert prepack_linears(model) == 2
    assert fuse_siblings(model, 10) == 0 and not _members(model)
    with torch.inference_mode():
        x = model.embed(torch.tensor([[1, 2]]))
        got = model(torch.tensor([[1, 2]])).last_hidden_state
    assert torch.allclose(got[..., 4:], torch.nn.functional.linear(2 * x, model.b.weight, model.b.bias), atol=1e-5)


class _NeedsMoreThanIds(_WritesIntoItsInput):
    def forward(self, input_ids, extra):
        return super().forward(input_ids)


def test_a_model_whose_forward_needs_more_than_token_ids_stays_ungrouped():
    model = _NeedsMoreThanIds()
    prepack_linears(model)
    assert fuse_siblings(model, 10) == 0 and not _members(model)


def test_load_model_groups_siblings_of_fp32_cpu_models_only(tiny_dir):
    assert len(_members(load_model(tiny_dir).model)) == 5 * 3
    assert not _members(load_model(tiny_dir, prepack=False).model)
    assert not _members(load_model(tiny_dir, dtype="bfloat16").model)
