"""Threads: the model and prefix cache are shared, working caches are not."""

import pytest

from beam_prefix import PrefixClassifier

from conftest import BANKING_LABELS, TEXTS, assert_same_predictions, prefix_checksum, run_in_threads, tiny_task


@pytest.mark.parametrize("prefix_attention", ["shared", "expanded"])
@pytest.mark.parametrize("share_instance", [False, True])
def test_concurrent_classify_matches_single_thread(tiny_models, share_instance, prefix_attention):
    clf = PrefixClassifier(task=tiny_task(BANKING_LABELS), loaded=tiny_models["qwen2_sliding"],
                           verify=False, batch_size=3, prefix_attention=prefix_attention)
    expected = clf.classify(TEXTS)
    checksum = prefix_checksum(clf.prefix_cache)
    workers = [clf if share_instance else clf.fork() for _ in range(4)]
    if prefix_attention == "shared":  # nothing mutable per instance at all
        assert all(w._working is None for w in workers)
    elif not share_instance:
        assert len({id(w._working) for w in workers}) == 4
        assert all(w.prefix_cache is clf.prefix_cache and w.model is clf.model for w in workers)

    def job(i):
        texts = TEXTS[i:] + TEXTS[:i]  # different batch compositions per thread
        out = []
        for _ in range(3):
            out.append(dict(zip(texts, workers[i].classify(texts))))
        return out

    for per_thread in run_in_threads(job, 4):
        for got in per_thread:
            assert_same_predictions([got[t] for t in TEXTS], expected, atol=1e-5)
    assert all(w.cache_length() == clf.prefix_length for w in workers)
    assert prefix_checksum(clf.prefix_cache) == checksum
