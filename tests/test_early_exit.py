"""The forward's early exit: features and heads that read no layer past k run k layers, and
give what the full-depth forward and full re-encoding give (tiny random models of every
architecture, both engines; the embedded model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from beam_prefix import PrefixClassifier
from beam_prefix.model.early_exit import exit_depth, shallow
from beam_prefix.model.loading import LoadedModel

from conftest import ARCHS, TEXTS, _tiny, assert_same_predictions, tiny_task
from test_head import _head_for


class _LayerCount:
    """How many decoder-layer forwards ran (hooks on every layer of the model)."""

    def __init__(self, base):
        total = base.config.get_text_config().num_hidden_layers
        self.layers = next(m for m in base.children() if isinstance(m, torch.nn.ModuleList) and len(m) == total)
        self.runs = 0
        self.hooks = [layer.register_forward_hook(self._count) for layer in self.layers]

    def _count(self, *_):
        self.runs += 1

    def close(self):
        for hook in self.hooks:
            hook.remove()


def test_exit_depth_reads_hidden_state_indices():
    config = _tiny("llama", 64).config  # 3 layers: hidden states 0..3, 3 and -1 the final one
    assert exit_depth(config, None) is None
    assert exit_depth(config, (-1,)) is None and exit_depth(config, (1, 3)) is None
    assert exit_depth(config, (1,)) == 1 and exit_depth(config, (2, 1)) == 2
    assert exit_depth(config, (-2,)) == 2  # the output of layer 2, counted from the end
    assert exit_depth(config, (0,)) == 1  # the embeddings are captured as layer 1's input


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("engine", ["shared", "expanded"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_features_before_the_last_layer_run_fewer_layers_and_equal_full_reencoding(
        chat_tokenizer, plain_tokenizer, arch, engine, pooling):
    # a fresh model: the view is made before the full-depth model ever recorded hidden states
    loaded = LoadedModel(_tiny(arch, len(chat_tokenizer)), plain_tokenizer if arch == "gpt2" else chat_tokenizer,
                         f"fresh-{arch}")
    clf = PrefixClassifier(task=tiny_task(), loaded=loaded, verify=False, batch_size=7, prefix_attention=engine)
    counter = _LayerCount(loaded.model.base_model)
    try:
        early = clf.embed(TEXTS, layers=(2, 1), pooling=pooling)
        assert counter.runs == 2 * -(-len(TEXTS) // 7)  # two layers per batch, not three
        counter.runs = 0
        deep = clf.embed(TEXTS, layers=(2, 1, -1), pooling=pooling)
        assert counter.runs == 3 * -(-len(TEXTS) // 7)
    finally:
        counter.close()
    full = clf.embed_full(TEXTS, layers=(2, 1), pooling=pooling)  # re-encoding runs every layer
    width = len(early[0].features)
    for e, d, f in zip(early, deep, full):
        assert np.allclose(e.features, f.features, atol=1e-4)
        assert np.allclose(e.features, d.features[:width], atol=1e-5)  # the same states as the full-depth pass
    assert clf.cache_length() == clf.prefix_length


@pytest.mark.parametrize("arch", ["llama", "qwen2_sliding", "gpt2"])
def test_a_head_on_early_layers_answers_as_its_reference_and_self_checks(tiny_models, arch):
    loaded = tiny_models[arch]
    base = PrefixClassifier(task=tiny_task(), loaded=loaded, verify=False)
    head = _head_for(base, layers=(1,), pooling="mean")
    clf = PrefixClassifier(task=base.task.replace(scoring="head", head=head), loaded=loaded, verify=True, batch_size=5)
    assert_same_predictions(clf.classify(TEXTS), clf.classify_full(TEXTS))


def test_views_are_made_once_and_share_the_models_weights(tiny_models):
    base = tiny_models["llama"].model.base_model
    view = shallow(base, 2)
    assert shallow(base, 2) is view and shallow(base, 1) is not view
    assert view.embed_tokens.weight is base.embed_tokens.weight
    assert len(view.layers) == 2 and len(base.layers) == 3  # the model itself is untouched
    assert base.config.num_hidden_layers == 3 and view.config.num_hidden_layers == 2


def test_early_layers_of_the_embedded_model_equal_full_reencoding(embedded):
    clf = PrefixClassifier(task=tiny_task(), loaded=embedded, verify=False, batch_size=5)
    layers = (6, 12)
    cached = clf.embed(TEXTS[:9], layers=layers, pooling="mean")
    full = clf.embed_full(TEXTS[:9], layers=layers, pooling="mean")
    diff = max(abs(a - b) for c, f in zip(cached, full) for a, b in zip(c.features, f.features))
    assert diff < 1e-3, f"max feature difference {diff:.2e}"
