"""Threads: the model and prefix cache are shared, working caches are not."""

import pytest
import torch

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


# -- the thread count of a step without `threads` (#34.8) -----------------------------------

def _drive(choice, cost_of, batches):
    """Run `batches` batches through `choice`, each costing `cost_of(threads, i)` s per token."""
    picked = []
    for i in range(batches):
        n = choice.pick()
        picked.append(n)
        choice.record(n, cost_of(n, i) * 100, 100)
    return picked


def test_thread_choice_follows_the_faster_count_and_notices_a_load_change():
    from beam_prefix.beam.thread_choice import ThreadChoice

    choice = ThreadChoice(4, probe_every=8)
    quiet = {4: 1.0, 1: 3.0}  # all cores 3x faster on a quiet machine
    busy = {4: 5.0, 1: 3.0}   # beside a busy process, spinning threads lose to one
    picked = _drive(choice, lambda n, i: quiet[n], 40)
    assert sorted(picked[:4]) == [1, 1, 4, 4] and choice.chosen() == 4
    # then only probes run 1 thread, the gap doubling while they confirm: batches 13 and 29
    assert [i + 1 for i, n in enumerate(picked) if n == 1][2:] == [13, 29]
    picked = _drive(choice, lambda n, i: busy[n], 40)  # the chosen count's own times show it
    assert choice.chosen() == 1 and picked[3:].count(4) <= 2  # a probe or two of all cores
    picked = _drive(choice, lambda n, i: quiet[n], 40)  # only a probe can show this one
    assert choice.chosen() == 4 and picked[-8:].count(4) >= 7
    assert ThreadChoice(1).candidates == (1,)


def test_thread_choice_on_one_core_keeps_one_thread_past_the_probes():
    """A worker with one core (or torch at one thread before any step set one) has one
    count, so nothing to probe: this divided by zero at the first probe (the 19th batch of
    each worker process at the defaults), failing that batch's rows."""
    from beam_prefix.beam.thread_choice import ThreadChoice

    choice = ThreadChoice(1, probe_every=2, max_probe_every=4)
    assert _drive(choice, lambda n, i: 1.0, 40) == [1] * 40 and choice.chosen() == 1


def test_thread_choice_is_safe_from_many_threads():
    from beam_prefix.beam.thread_choice import ThreadChoice

    choice = ThreadChoice(2, probe_every=4)

    def work(i):
        for _ in range(200):
            n = choice.pick()
            choice.record(n, 0.001 * n, 10)
        return True

    assert all(run_in_threads(work, 8))
    assert choice.chosen() == 1  # 1 thread costs less here


def test_a_step_without_threads_times_its_batches_with_the_choice(tiny_dir, monkeypatch):
    """The DoFn asks the process's choice for each batch's count, runs with it, and
    records its time per suffix token; a step with `threads` leaves the choice alone."""
    import apache_beam as beam

    from beam_prefix.beam import worker
    from beam_prefix.beam.thread_choice import ThreadChoice
    from beam_prefix.transforms import ClassifyText

    recorded, seen = [], []
    choice = ThreadChoice(2)
    original = choice.record
    monkeypatch.setattr(choice, "record", lambda n, s, t: (recorded.append((n, t)), original(n, s, t)))
    monkeypatch.setattr(worker, "THREADS", choice)
    from beam_prefix.beam.classify_dofn import PrefixCachedClassifyDoFn

    monkeypatch.setattr(PrefixCachedClassifyDoFn, "_call", _recording_call(seen))
    threads = torch.get_num_threads()
    try:
        with beam.Pipeline() as p:
            rows = p | beam.Create([{"text": t} for t in TEXTS[:12]])
            _ = rows | "Auto" >> ClassifyText(task=tiny_task(), model=tiny_dir, verify=False, max_batch_size=3)
        assert recorded and [n for n, _ in recorded] == [n for n in seen]
        assert all(t > 0 for _, t in recorded) and {n for n in seen} == {1, 2}
        recorded.clear(), seen.clear()
        with beam.Pipeline() as p:
            rows = p | beam.Create([{"text": t} for t in TEXTS[:6]])
            _ = rows | "Set" >> ClassifyText(task=tiny_task(), model=tiny_dir, verify=False, threads=1)
        assert recorded == [] and set(seen) == {1}
    finally:
        torch.set_num_threads(threads)


def _recording_call(seen):
    from beam_prefix.beam.classify_dofn import PrefixCachedClassifyDoFn

    original = PrefixCachedClassifyDoFn._call

    def call(self, engine, encoded):
        seen.append(torch.get_num_threads())
        return original(self, engine, encoded)

    return call
