"""The benchmark runs end to end on a tiny model and writes its files (no timing asserted:
speed is shown by `make bench`, in ratios from one run)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import speedup


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_speedup_benchmark_runs_on_a_tiny_model(tiny_dir, tmp_path):
    report = speedup.run([
        f"--model={tiny_dir}", "--support_rows=6", "--banking77_rows=2", "--batch_sizes=1,4",
        "--banking77_batch_sizes=1,4", "--banking77_a_rows=2",
        "--scaling_tokens=150,400", "--scaling_a_rows=2", "--rss_rows=8", "--modes=int8",
        "--sliding_rows=3", "--sliding_batch_sizes=1,3", f"--out_dir={tmp_path}"])
    for name in ("speedup.json", "speedup.md", "prefix_scaling.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "speedup.json").read_text())["workloads"].keys() == {"support", "banking77"}
    for name, workload in report["workloads"].items():
        names = [c["name"] for c in workload["contenders"]]
        sequence = workload["scoring"] == "sequence"
        assert [n[0] for n in names] == ["A", "B", "C", "C", "C"] + (["C"] if sequence else []) + ["D"], names
        assert names[4] == "C with the expanded working cache"
        assert len(workload["rounds"]["C"]) == len(workload["rounds"]["D"]) == 2  # interleaved, best of two
        assert workload["d_over_c_throughput"] == min(workload["rounds"]["C"]) / min(workload["rounds"]["D"])
        # B (the recipe), C and D are exact in fp32: the same labels as full re-encoding
        assert all(c["agreement"] == 1.0 for c in workload["contenders"]), (name, workload["contenders"])
        assert workload["floor"]["floor_ms_per_row"] > 0
        one = workload["batch_one"]  # B and C at batch 1, interleaved, with the one-row floor
        assert len(one["rounds"]["B"]) == len(one["rounds"]["C"]) == 2 and one["agreement"] == 1.0
        assert one["c_over_b"] == one["b_ms_per_row"] / one["c_ms_per_row"] and one["floor_ms_per_row"] > 0
        d = workload["contenders"][-1]
        assert d["beam_batch"] == 4 * d["batch"] == 4 * workload["best_c"]["batch"]
        assert "_a_labels" not in workload
    assert report["workloads"]["banking77"]["scoring"] == "sequence"
    pruned = report["workloads"]["banking77"]["pruned_vs_exhaustive"]
    assert pruned["label_agreement"] == 1.0 and pruned["max_prob_diff"] <= 1e-4
    assert 0 < pruned["pruned_label_tokens_per_row"] <= pruned["exhaustive_label_tokens_per_row"]
    sliding = report["sliding"]
    assert [(r["engine"], r["batch"]) for r in sliding["runs"]] == [
        ("shared", 1), ("shared", 3), ("expanded", 1), ("expanded", 3)]
    assert sliding["shared_max_prob_diff_vs_full"] <= 1e-4 and sliding["expanded_max_prob_diff_vs_full"] <= 1e-4
    assert [p["prefix_tokens"] for p in report["scaling"]] == sorted(p["prefix_tokens"] for p in report["scaling"])
    assert report["rss"]["rss_mb_1_thread"] > 0 and report["modes"][0]["mode"] == "int8"


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_routing_benchmark_runs_on_a_tiny_model(tiny_dir, tmp_path):
    from benchmarks import routing

    report = routing.run([f"--model={tiny_dir}", "--tasks=3", "--rows=12", "--rounds=1", "--capped_tasks=1",
                          f"--out_dir={tmp_path}"])
    assert json.loads((tmp_path / "routing.json").read_text())["tasks"] == 3
    contenders = report["contenders"]
    assert set(contenders) == {"routed", "per_task", "capped"}
    assert all(c["agreement"] == 1.0 and c["peak_rss_mb"] > 0 for c in contenders.values())
    assert contenders["routed"]["prefix_builds"] == 3 and contenders["routed"]["prefix_evictions"] == 0
    # the cap (1.5 of the first task's prefix) can hold a large and a small prefix but never the two
    # large ones (tasks 0 and 2), so at least one eviction; rebuilds past 3 depend on the runner's order
    assert contenders["capped"]["prefix_evictions"] > 0 and contenders["capped"]["prefix_builds"] >= 3
    assert report["routed_over_per_task"] == contenders["routed"]["rows_per_s"] / contenders["per_task"]["rows_per_s"]


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_extraction_benchmark_runs_on_a_tiny_model(tiny_dir, tmp_path):
    from benchmarks import extraction

    report = extraction.run([f"--model={tiny_dir}", "--rows=5", "--a_rows=2", "--rounds=1", f"--out_dir={tmp_path}"])
    assert json.loads((tmp_path / "extraction.json").read_text())["rows"] == 5
    assert report["identical"] == {"A": True, "B": True}  # the same tokens from all three contenders
    assert set(report["ms_per_row"]) == {"A", "B", "C"} and report["generated_tokens_per_row"] > 0
    assert "model: decode steps" in report["c_time_split_s"]
    assert report["accuracy"]["rows"] == 166 and set(report["accuracy"]["fields"]) == {
        "product_area", "order_id", "amount", "urgency", "refund_requested"}


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_extraction_heads_benchmark_runs_on_a_tiny_model(tiny_dir, tmp_path):
    pytest.importorskip("pycrfsuite")  # the `crf` extra, which make bench-extraction installs
    from benchmarks import extraction_heads

    report = extraction_heads.run(rows_per_intent=20, timed_rows=3, rounds=1, intents=["SearchCreativeWork"],
                                  train_limit=40, model=tiny_dir, out_dir=str(tmp_path))
    assert json.loads((tmp_path / "extraction_heads.json").read_text())["test_rows"] == 100
    assert set(report["micro_f1"]) == {"head, 70", "head, all", "CRF, 70", "CRF, all", "decoding"}
    assert all(0 <= v <= 1 for v in report["micro_f1"].values())
    assert report["tickets"]["held_out_rows"] == 86 and report["tickets"]["train_rows"] == 80
    assert "| all five fields |" in (tmp_path / "extraction_heads.md").read_text()


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_peers_benchmark_runs_ours_and_says_why_llama_cpp_is_skipped(tiny_dir, tmp_path):
    from benchmarks import peers

    report = peers.run([f"--model={tiny_dir}", "--rows=8", "--batch=4", "--rounds=2", "--profile",
                        "--profile_rows=4", f"--out_dir={tmp_path}"])
    assert "no GGUF" in report["skipped"] or "not installed" in report["skipped"]
    names = [f"C batch {b}{v}" for b in (4, 1) for v in ("", ", siblings not grouped", ", weights not prepacked")]
    assert list(report["contenders"]) == names
    for name, c in report["contenders"].items():
        assert len(c["rounds"]) == 2 and c["ms_per_row"] == min(c["rounds"])
        assert c["agreement_with_c"] == 1.0, name  # prepacked or not, any batch: the same labels
    assert report["contenders"]["C batch 1, weights not prepacked"]["c_speed_vs"] == (
        min(report["contenders"]["C batch 1, weights not prepacked"]["rounds"])
        / min(report["contenders"]["C batch 1"]["rounds"]))
    assert [(p["batch"], p["variant"]) for p in report["profile"]] == [
        (b, v) for b in (4, 1) for v in ("plain", "ungrouped", "loaded")]
    assert all(p["ops"] and p["ops"][0]["self_ms_per_row"] > 0 for p in report["profile"])
    md = (tmp_path / "peers.md").read_text()
    assert report["skipped"] in md and "| C batch 4 |" in md
    assert json.loads((tmp_path / "peers.json").read_text())["rows"] == 8


@pytest.mark.slow  # builds on llama-cpp-python (make bench-peers installs it) and the embedded model
def test_llama_cpp_reads_our_token_ids_and_agrees_on_the_same_weights(tmp_path):
    pytest.importorskip("llama_cpp")
    from benchmarks import peers

    report = peers.run(["--rows=8", "--batch=4", "--rounds=1", "--kinds=F32", "--one_row=F32",
                        f"--out_dir={tmp_path}"])
    assert report["skipped"] is None and report["token_mismatches"] == {"F32": 0}
    llama = {n: c for n, c in report["contenders"].items() if n.startswith("L F32")}
    assert len(llama) == 4  # batched and one row, each with flash attention on and off
    assert all(c["agreement_with_c"] == 1.0 for c in llama.values()), llama


def test_gpu_benchmark_says_it_is_skipped_without_cuda(capsys, tmp_path, monkeypatch):
    from benchmarks import gpu

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu.run([f"--out_dir={tmp_path}"]) is None
    assert "skipped: no CUDA device" in capsys.readouterr().out and not list(tmp_path.iterdir())


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_gpu_benchmark_harness_runs_on_the_cpu_with_a_tiny_model(tiny_dir, tmp_path):
    from benchmarks import gpu

    report = gpu.run(["--device=cpu", f"--model={tiny_dir}", "--batch_sizes=2,4,8", "--extract_batch_sizes=2,4",
                      "--rows=8", "--extract_rows=4", "--rounds=1", "--workloads=lm,extract", "--batch_one_rows=3",
                      f"--out_dir={tmp_path}"])
    assert json.loads((tmp_path / "gpu.json").read_text())["workloads"].keys() == {"lm", "lm, buckets", "extract"}
    assert "| lm |" in (tmp_path / "gpu.md").read_text() and "| lm, buckets |" in (tmp_path / "gpu.md").read_text()
    # the buckets ask the host nothing inside the pass: the packed path's nonzero is gone
    assert (report["workloads"]["lm, buckets"]["profiled"]["host_syncs_per_batch"]
            < report["workloads"]["lm"]["profiled"]["host_syncs_per_batch"])
    lm = report["workloads"]["lm"]
    assert set(lm["batch_one_ms_per_row"]) == {"cached", "full_reencoding"}
    exact = report["workloads"]["lm, buckets"]["exactness"]
    assert lm["exactness"]["max_score_diff_vs_full"] < 1e-4 and exact["max_score_diff_vs_full"] < 1e-4
    assert exact["labels_equal_to_packed"] == 1.0 and exact["max_score_diff_vs_packed"] < 1e-5
    assert set(lm["rows_per_s"]) == {2, 4, 8} and all(r > 0 for r in lm["rows_per_s"].values())
    assert lm["profiled"]["batch"] == 4 and lm["profiled"]["batches"] == 2
    assert lm["profiled"]["host_syncs_per_batch"] > 0  # the profiler saw the engine's syncs
    assert all(r > 0 for r in report["bound_plain_forward_rows_per_s"].values())


@pytest.mark.slow  # the benchmark harness, not an exactness test: make test-slow
def test_against_commit_times_a_base_commit_and_this_tree_on_the_same_rows(tiny_dir, tmp_path):
    from benchmarks import against_commit
    from benchmarks.data import ROOT

    report = against_commit.run(["--base=HEAD", f"--model={tiny_dir}", "--rows=6", "--one_row_rows=3", "--batch=4",
                                 "--rounds=2", "--extract_rows=2", f"--out_dir={tmp_path}", "--name=ac"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert report["base"] == head and report["this_tree"].startswith(head)
    assert list(report["classes"]) == ["batch 4", "batch 1", "extraction, batch 4"]
    for c in report["classes"].values():
        assert len(c["base_rounds"]) == len(c["this_tree_rounds"]) == 2
        assert c["base_best"] == min(c["base_rounds"]) and c["median_ratio"] > 0
        assert c["same_answers"]  # the same code on both sides gives the same labels and generated text
    md = (tmp_path / "ac.md").read_text()
    assert "| batch 1, 3 rows |" in md and f"this tree: {head[:10]}" in md and "`ticket_fields.yaml`" in md
    assert json.loads((tmp_path / "ac.json").read_text())["rounds"] == 2


def test_against_commit_refuses_a_revision_that_is_not_a_commit(tmp_path):
    from benchmarks import against_commit

    with pytest.raises(SystemExit, match="'no-such-revision-here' is not a commit"):
        against_commit.run(["--base=no-such-revision-here", f"--out_dir={tmp_path}"])
    assert not list(tmp_path.iterdir())  # refused before any worker or report


def test_baselines_runs_the_contenders_asked_for_and_refuses_a_tuned_one_without_its_base(tmp_path):
    from benchmarks import baseline_contenders as contenders
    from benchmarks import baselines

    assert contenders.chosen_contenders("ours_exit6_tuned_bf16, minilm,ours_exit6_bf16") == [
        "minilm", "ours_exit6_bf16", "ours_exit6_tuned_bf16"]  # the table's order
    assert contenders.chosen_contenders(",".join(contenders.CONTENDERS)) == list(contenders.CONTENDERS)
    for value, words in (("minilm,ours_exit6_tuned_bf16", "needs ours_exit6_bf16"), ("minilm,bogus", "unknown"),
                         (",", "empty")):
        with pytest.raises(SystemExit, match=words):  # before any model or data is read
            baselines.run([f"--contenders={value}", f"--out_dir={tmp_path}"])
    assert not list(tmp_path.iterdir())
    # every tuned contender's base is an untuned contender of the same precision
    for key, base in contenders.BASES.items():
        assert contenders.CONTENDERS[key].dtype == contenders.CONTENDERS[base].dtype, key
        assert base not in contenders.BASES


def test_layer_survey_surveys_the_layer_sets_asked_for(tmp_path):
    import numpy as np

    from benchmarks import layer_survey

    assert layer_survey._layer_sets("6; 3,6;") == ((6,), (3, 6))
    assert layer_survey._layer_sets("") == ()
    with pytest.raises(SystemExit, match=r"\[6\] not in --layers 3,4"):  # before any model or data is read
        layer_survey.run(["--layers=3,4", "--candidates=3;6", "--label_row_candidates=", f"--out_dir={tmp_path}"])
    assert not list(tmp_path.iterdir())
    # the states of layers 3 and 4 side by side: layer 4's carry the label, layer 3's are noise
    rng = np.random.default_rng(0)
    y = np.arange(90) % 3
    x3, x4 = rng.normal(size=(90, 8)), rng.normal(size=(90, 8))
    x4[np.arange(90), y] += 4.0
    rows = layer_survey.survey(np.hstack([x3, x4]).astype(np.float32), [f"row {i}" for i in range(90)],
                               [f"label{v}" for v in y], surveyed=(3, 4), candidates=((3,), (4,), (3, 4)),
                               label_row_candidates=())
    by = {tuple(r["layers"]): r for r in rows}
    assert list(by) == [(3,), (4,), (3, 4)]
    assert by[(4,)]["hidden_states"] > 0.9 > 0.6 > by[(3,)]["hidden_states"]
    assert by[(4,)]["last_layer"] == 4


def test_layer_survey_refuses_features_kept_for_other_layers(tmp_path):
    import numpy as np

    from benchmarks import layer_survey

    kept = tmp_path / "features.npz"
    np.savez(kept, x=np.ones((2, 6), dtype=np.float16), layers=np.array([1, 2]))
    assert layer_survey._features(["a", "b"], str(kept), (1, 2)).shape == (2, 6)  # reused, no model loaded
    with pytest.raises(SystemExit, match=r"computed for layers \[1, 2\], not \[1, 2, 3\]"):
        layer_survey._features(["a", "b"], str(kept), (1, 2, 3))
    np.savez(kept, x=np.ones((2, 6), dtype=np.float16))  # kept before the layers were recorded
    with pytest.raises(SystemExit, match="not recorded"):
        layer_survey._features(["a", "b"], str(kept), (1, 2))
