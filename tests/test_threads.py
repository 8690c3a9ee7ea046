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


def test_loads_in_threads_at_once_run_one_at_a_time_and_leave_loading_working(tiny_dir, tmp_path, monkeypatch):
    """transformers patches torch's init functions process-wide while it builds a model: two
    loads at once failed both ('Cannot copy out of meta tensor') and every later one
    (reproduced with the embedded model, four threads). Loads now run one at a time; a
    failed one among them leaves nothing behind."""
    import threading
    import time

    from beam_prefix import ModelLoadError
    from beam_prefix.model import loading

    active, most = [0], [0]
    real = loading._from_directory

    def watched(*args, **kwargs):  # how many loads are inside transformers at once
        active[0] += 1
        most[0] = max(most[0], active[0])
        try:
            time.sleep(0.2)  # wide enough for the others to arrive
            return real(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(loading, "_from_directory", watched)
    tasks = [tiny_task(labels) for labels in (("billing", "technical", "account"), ("yes", "no"),
                                               ("spam", "ham", "unsure"), ("red", "green", "blue", "other"))]
    barrier = threading.Barrier(len(tasks) + 1)

    def load(i):
        barrier.wait()  # all start loading at the same moment
        if i == len(tasks):
            with pytest.raises(ModelLoadError):
                PrefixClassifier.load(tasks[0], model=str(tmp_path / "no-such-model"), verify=False)
            return None
        return PrefixClassifier.load(tasks[i], model=tiny_dir, verify=False)

    loaded = run_in_threads(load, len(tasks) + 1)[:-1]
    assert most[0] == 1
    for task, clf in zip(tasks, loaded):
        assert clf.task.label_names == task.label_names
        assert not any(p.is_meta for p in clf.model.parameters())
    again = PrefixClassifier.load(tasks[0], model=tiny_dir, verify=True)  # the process still loads
    assert_same_predictions(again.classify(TEXTS[:4]), loaded[0].classify(TEXTS[:4]), atol=1e-5)
