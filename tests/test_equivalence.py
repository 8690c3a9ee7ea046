"""The headline property: cached scoring equals full re-encoding of the whole prompt.

NOTE: tiny models use initializer_range=0.3 so their label distributions are far from
uniform (checked by `score_spread`); a wrong mask, position or cache would show as a
difference far above the tolerance.
"""

import random

import pytest
import torch

from beam_prefix import PrefixClassifier

from conftest import ARCHS, BANKING_LABELS, TEXTS, assert_same_predictions, prefix_checksum, score_spread, tiny_task


def _classifier(loaded, task, **kwargs):
    return PrefixClassifier(task=task, loaded=loaded, verify=False, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scoring,labels", [("first_token", ("billing", "technical", "account")),
                                            ("sequence", tuple(BANKING_LABELS))])
@pytest.mark.parametrize("batch_size", [1, 3, 17])
def test_cached_equals_full(tiny_models, arch, scoring, labels, batch_size):
    # the engine's exactness, every label's log-probability included: exhaustive search
    # (pruned search == exhaustive is tests/test_label_search.py)
    clf = _classifier(tiny_models[arch], tiny_task(labels, scoring=scoring), batch_size=batch_size,
                      label_search="exhaustive")
    assert clf.prefix_attention == "shared"
    assert clf.mode == scoring
    if arch.endswith("sliding"):  # the prefix must overflow the window for the test to mean much
        assert clf.prefix_length > 24
    cached = clf.classify(TEXTS)
    full = clf.classify_full(TEXTS)
    assert_same_predictions(cached, full)
    assert score_spread(full) > 0.2
    assert clf.cache_length() == clf.prefix_length


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scoring,labels", [("first_token", ("billing", "technical", "account")),
                                            ("sequence", tuple(BANKING_LABELS))])
def test_expanded_working_cache_equals_full(tiny_models, arch, scoring, labels):
    """The other engine (any attention implementation): a DynamicCache on the expanded prefix."""
    clf = _classifier(tiny_models[arch], tiny_task(labels, scoring=scoring), batch_size=3,
                      prefix_attention="expanded", label_search="exhaustive")
    assert clf.prefix_attention == "expanded"
    assert_same_predictions(clf.classify(TEXTS), clf.classify_full(TEXTS))
    assert clf.cache_length() == clf.prefix_length


_EMBEDDED_FULL: list = []  # full re-encoding of TEXTS (it does not depend on the batch size): once


@pytest.mark.parametrize("batch_size", [1, 3, 17])
def test_embedded_cached_equals_full(embedded, batch_size):
    clf = _classifier(embedded, tiny_task(), batch_size=batch_size)
    cached = clf.classify(TEXTS)
    if not _EMBEDDED_FULL:
        _EMBEDDED_FULL.extend(clf.classify_full(TEXTS))
    assert_same_predictions(cached, _EMBEDDED_FULL)
    assert clf.cache_length() == clf.prefix_length


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding", "gpt2"])
def test_batch_invariance(tiny_models, arch):
    clf = _classifier(tiny_models[arch], tiny_task(BANKING_LABELS, scoring="sequence"), batch_size=5)
    alone = {t: clf.classify([t])[0].logprobs for t in TEXTS}
    shuffled = TEXTS[:]
    random.Random(3).shuffle(shuffled)
    for text, pred in zip(shuffled, clf.classify(shuffled)):
        for name, logp in alone[text].items():
            assert abs(pred.logprobs[name] - logp) <= 1e-3, (text, name)


def _brute_force(model, prompt_ids, label_ids):
    """Log-likelihood of each label: the whole prompt + label re-encoded, one label at a time."""
    scores = []
    with torch.inference_mode():
        for label in label_ids:
            ids = torch.tensor([list(prompt_ids) + list(label)])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            n = len(prompt_ids)
            scores.append(sum(logp[n - 1 + j, tok] for j, tok in enumerate(label)))
    return torch.log_softmax(torch.stack(scores), dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2_sliding", "gpt2"])
def test_multi_token_labels_match_brute_force(tiny_models, arch):
    clf = _classifier(tiny_models[arch], tiny_task(BANKING_LABELS), batch_size=4, label_search="exhaustive")
    assert clf.mode == "sequence"  # auto: card_/cash_/top_up_ share first tokens
    firsts = [ids[0] for ids in clf.label_ids]
    assert len(set(firsts)) < len(firsts)
    texts = TEXTS[:6]
    for text, pred in zip(texts, clf.classify(texts)):
        prompt_ids, _ = clf.layout.encode_full(text)
        reference = _brute_force(clf.model, prompt_ids, clf.label_ids)
        got = torch.tensor([pred.logprobs[n] for n in BANKING_LABELS])
        assert torch.allclose(got, reference, atol=2e-3), (text, got, reference)


def test_embedded_multi_token_labels_match_brute_force(embedded):
    clf = _classifier(embedded, tiny_task(BANKING_LABELS), batch_size=3, label_search="exhaustive")
    assert clf.mode == "sequence"
    texts = ["My new card has still not arrived", "I got charged a fee for withdrawing cash"]
    for text, pred in zip(texts, clf.classify(texts)):
        prompt_ids, _ = clf.layout.encode_full(text)
        reference = _brute_force(clf.model, prompt_ids, clf.label_ids)
        got = torch.tensor([pred.logprobs[n] for n in BANKING_LABELS])
        assert torch.allclose(got, reference, atol=2e-3), (text, got, reference)


@pytest.mark.parametrize("prefix_attention", ["expanded", "shared"])
@pytest.mark.parametrize("scoring", ["first_token", "sequence"])
def test_crop_discipline_after_calls_and_exceptions(tiny_models, scoring, prefix_attention, monkeypatch):
    labels = BANKING_LABELS if scoring == "sequence" else ("billing", "technical", "account")
    clf = _classifier(tiny_models["mistral_sliding"], tiny_task(labels, scoring=scoring), batch_size=4,
                      prefix_attention=prefix_attention)
    assert (clf._working is None) == (prefix_attention == "shared")
    before = prefix_checksum(clf.prefix_cache)
    expected = clf.classify(TEXTS[:8])
    assert clf.cache_length() == clf.prefix_length

    base = clf.model.base_model
    original = type(base).forward
    calls = {"n": 0}

    def failing_forward(self, *args, **kwargs):
        calls["n"] += 1
        # grow the working cache first, as a real mid-forward failure would
        out = original(self, *args, **kwargs)
        raise RuntimeError("injected failure after the cache grew")

    monkeypatch.setattr(type(base), "forward", failing_forward)
    with pytest.raises(RuntimeError, match="injected"):
        clf.classify(TEXTS[:3])
    assert calls["n"] == 1
    assert clf.cache_length() == clf.prefix_length
    monkeypatch.setattr(type(base), "forward", original)

    again = clf.classify(TEXTS[:8])
    assert_same_predictions(again, expected, atol=1e-6)
    assert clf.cache_length() == clf.prefix_length
    assert prefix_checksum(clf.prefix_cache) == before  # the shared prefix was never written


def test_verify_catches_a_broken_cache(tiny_models):
    """verify() must fail when the cached path is wrong: shift the cached prefix by one."""
    from beam_prefix.errors import VerificationError

    clf = _classifier(tiny_models["llama"], tiny_task())
    clf.verify()
    broken = clf.fork()
    for state in broken.prefix_cache.layers:
        state.keys.mul_(1.5)  # corrupt the shared prefix in place
    with pytest.raises(VerificationError, match="disagrees"):
        broken.verify()


def test_full_reference_uses_no_cache_and_matches_model_logits(tiny_models):
    clf = _classifier(tiny_models["llama"], tiny_task())
    ids, _ = clf.layout.encode_full(TEXTS[0])
    raw = clf.scorer.full(clf.model, ids)
    with torch.inference_mode():
        logits = clf.model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
    assert torch.allclose(raw, logits[clf.scorer.first_ids])


def test_self_check_times_steady_state_after_one_warm_call(tiny_models, monkeypatch):
    """The start-up self-check's cached-vs-full timing excludes the first call's warm-up:
    one untimed cached call on a probe, then the timed calls on all of them."""
    clf = _classifier(tiny_models["llama"], tiny_task())
    calls = []
    original = PrefixClassifier.classify

    def recording(self, texts):
        calls.append(("cached", list(texts)))
        return original(self, texts)

    monkeypatch.setattr(PrefixClassifier, "classify", recording)
    clf.verify(TEXTS[:3])
    assert calls == [("cached", TEXTS[:1]), ("cached", TEXTS[:3])]
    assert clf.last_check["cached_ms_per_row"] > 0 and clf.last_check["full_ms_per_row"] > 0
