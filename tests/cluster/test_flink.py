"""The plugin on a real Flink (#62.1), run by `make test-flink`: the CLIs and a job of a
user's own on Flink 1.19 (embedded in Beam's job server at parallelism 2, and a standalone
cluster of JobManager and TaskManager processes), with PROCESS SDK workers in an
environment built from the wheel that has no embedded model (the launcher stages it under
--temp_location). Every output equals the DirectRunner's on the same rows (same labels,
scores within float tolerance, same fields), every input row ends in exactly one output,
the step's metrics come back in the job's results (the summary's counts are them), and a
killed SDK worker is restarted by Flink with every row published exactly once."""

from __future__ import annotations

import glob
import json
import pathlib
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flink_harness import HOME, ROOT, cluster_flink, direct, embedded_flink, kill_a_worker, launcher_model  # noqa: F401

pytestmark = [pytest.mark.flink,
              pytest.mark.skipif(not HOME, reason="needs a Flink prepared by `make test-flink` (BEAM_PREFIX_FLINK_HOME)")]
DATA = ROOT / "beam_prefix" / "shipped" / "data"
TOLERANCE = 1e-4  # scores: float32 sums in another order on another worker count


def _rows(prefix: str) -> list[dict]:
    files = sorted(glob.glob(f"{prefix}-*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def _by_id(rows: list[dict], key: str = "ticket_id") -> dict:
    out = {}
    for r in rows:
        assert r[key] not in out, f"row {r[key]} written twice"
        out[r[key]] = r
    return out


def _same_labels(flink: list[dict], ref: list[dict]) -> None:
    a, b = _by_id(flink), _by_id(ref)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["label"] == b[key]["label"], key
        assert abs(a[key]["score"] - b[key]["score"]) <= TOLERANCE, (key, a[key]["score"], b[key]["score"])
        for col in (c for c in a[key] if c.startswith("prob_")):
            assert abs(a[key][col] - b[key][col]) <= TOLERANCE, (key, col)


def _failed(prefix: str) -> list[tuple]:
    return sorted((r["id"], r["reason"]) for r in _rows(prefix))


def csv_input(tmp_path, rows: int = 66, bad: bool = True) -> tuple[str, list[str]]:
    """The held-out tickets as CSV (repeated with new ids up to `rows`), and with `bad` two rows
    that fail (an empty text; a line with a field too many): the path and every row's id."""
    import csv

    with open(DATA / "heldout_tickets.csv", newline="", encoding="utf-8") as f:
        base = list(csv.DictReader(f))
    records = [{**base[i % len(base)], "ticket_id": f"R{i:05d}"} for i in range(rows)]
    path = tmp_path / "tickets.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, ["ticket_id", "text", "label"])
        writer.writeheader()
        writer.writerows(records)
        if bad:
            f.write("BAD1,,billing\nBAD2,too,many,fields\n")
    return str(path), [r["ticket_id"] for r in records] + (["BAD1", "BAD2"] if bad else [])


def parquet_input(tmp_path) -> tuple[str, list[str]]:
    """The sample tickets as Parquet, and a row with a null text (it fails)."""
    rows = pq.read_table(DATA / "sample_tickets.parquet").to_pylist() + [
        {"ticket_id": "NULL1", "text": None, "label": "billing"}]
    path = tmp_path / "tickets.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path), [r["ticket_id"] for r in rows]


def _check_run(proc, out: str) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.load(open(f"{out}-summary.json"))
    assert summary["accounted_for"], summary
    return summary


def _direct_output(tmp_path, common: list[str], *, module: str, what: str) -> str:
    """The same CLI and flags on the DirectRunner (the project's newest Beam): its output prefix."""
    ref = f"{tmp_path}/direct/{what}"
    _check_run(direct([*common, f"--output={ref}"], module=module, work=tmp_path), ref)
    return ref


def _on_flink_and_direct(flink, tmp_path, common: list[str], *, module: str, what: str, name: str, rows: int,
                         flink_only: tuple[str, ...] = ()):
    """Run a CLI with the `common` flags on `flink` and on the DirectRunner; returns (the Flink
    run's process, its summary, its output prefix, the DirectRunner's output prefix)."""
    out = f"{tmp_path}/flink/{what}"
    proc = flink.run([*flink.flags(), *flink_only, *common, f"--output={out}"], name=name, rows=rows, module=module)
    summary = _check_run(proc, out)
    return proc, summary, out, _direct_output(tmp_path, common, module=module, what=what)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_classify_on_flink_equals_the_direct_runner(fmt, embedded_flink, tmp_path):
    flink = embedded_flink
    source, ids = (csv_input if fmt == "csv" else parquet_input)(tmp_path)
    common = ["--task=support_tickets_head", f"--input={source}", "--id_column=ticket_id", "--eval_label_column=label"]
    proc, summary, out, ref = _on_flink_and_direct(
        flink, tmp_path, common, module="beam_prefix.pipelines.classify", what="labeled", name=f"classify {fmt}",
        rows=len(ids), flink_only=("--sdk_worker_parallelism=2",))
    _same_labels(_rows(out), _rows(ref))
    assert _failed(f"{tmp_path}/flink/failed") == _failed(f"{tmp_path}/direct/failed") != []
    # every input row in exactly one output, and the job's metrics (the summary) say the same
    labelled, failed = _by_id(_rows(out)), _failed(f"{tmp_path}/flink/failed")
    assert len({i for i, _ in failed}) == len(failed)
    assert set(labelled) | {i for i, _ in failed} == set(ids) and not set(labelled) & {i for i, _ in failed}
    assert (summary["rows_read"], summary["labeled"], summary["failed"]) == (len(ids), len(labelled), len(failed))
    # the workers had no embedded model: they fetched the launcher's staged copy into their own cache
    assert glob.glob(f"{flink.worker_cache}/embedded-*/model.safetensors")
    assert "staged for the workers" in proc.stderr


def test_extract_on_flink_equals_the_direct_runner(embedded_flink, tmp_path):
    flink = embedded_flink
    source, ids = csv_input(tmp_path, rows=8, bad=False)
    common = [f"--input={source}", "--id_column=ticket_id", "--task=ticket_fields"]
    _, _, out, ref = _on_flink_and_direct(flink, tmp_path, common, module="beam_prefix.pipelines.extract",
                                          what="extracted", name="extract csv", rows=len(ids))
    a, b = _by_id(_rows(out)), _by_id(_rows(ref))
    assert a.keys() == b.keys() == set(ids)
    for key in a:  # greedy decoding: the same fields, token for token
        assert {k: v for k, v in a[key].items() if k != "model"} == {k: v for k, v in b[key].items() if k != "model"}


def test_fit_with_its_features_from_flink_workers_writes_the_direct_runners_head(embedded_flink, tmp_path):
    from beam_prefix.tasks.trained_head import TrainedHead

    flink = embedded_flink
    before = len(list(flink.reports.glob("*.json"))) if flink.reports.exists() else 0
    common = ["--task=support_tickets", f"--input={DATA / 'sample_tickets.csv'}", "--label_column=label",
              "--layers=-1", "--folds=3"]
    proc = flink.run([*flink.flags(), *common, f"--output={tmp_path}/flink.head"], name="fit (features)", rows=60,
                     module="beam_prefix.pipelines.fit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(flink.reports.glob("*.json"))) > before  # the features came from Flink's workers
    ref = direct([*common, f"--output={tmp_path}/direct.head"], module="beam_prefix.pipelines.fit", work=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    a, b = TrainedHead.load(f"{tmp_path}/flink.head"), TrainedHead.load(f"{tmp_path}/direct.head")
    assert a.labels == b.labels and a.layers == b.layers and a.fingerprint == b.fingerprint
    assert (a.weight - b.weight).abs().max().item() <= 1e-3 and (a.mean - b.mean).abs().max().item() <= 1e-4


def test_a_users_own_job_with_classify_text_on_flink(embedded_flink, tmp_path):
    flink = embedded_flink
    script = str(pathlib.Path(__file__).with_name("own_job.py"))
    source, ids = csv_input(tmp_path, rows=20, bad=False)
    proc = flink.run([*flink.flags(), f"--input={source}", f"--output={tmp_path}/flink/own"], name="own job",
                     rows=len(ids), script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = direct([f"--input={source}", f"--output={tmp_path}/direct/own"], module=None, work=tmp_path, script=script)
    assert ref.returncode == 0, ref.stderr[-3000:]
    read = lambda d: {r["ticket_id"]: r for f in glob.glob(f"{tmp_path}/{d}/own*") for r in map(json.loads, open(f))}
    a, b = read("flink"), read("direct")
    assert a.keys() == b.keys() == set(ids)
    assert all(a[k]["label"] == b[k]["label"] and abs(a[k]["score"] - b[k]["score"]) <= TOLERANCE for k in a)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rows_classified"] == len(ids)  # the job's metrics


def test_a_killed_sdk_worker_is_restarted_and_every_row_published_once(embedded_flink, tmp_path):
    flink = embedded_flink
    source, ids = csv_input(tmp_path, rows=1200, bad=False)
    common = ["--task=support_tickets_head", f"--input={source}", "--id_column=ticket_id"]
    out = f"{tmp_path}/flink/labeled"
    killed: dict = {}
    killer = threading.Thread(target=lambda: killed.update(kill_a_worker(after_s=5, alive_s=8)))
    killer.start()
    proc = flink.run([*flink.flags(), "--sdk_worker_parallelism=2", *common, f"--output={out}"],
                     name="classify, a worker killed", rows=len(ids), module="beam_prefix.pipelines.classify")
    killer.join()
    assert killed, "no SDK worker was running to kill"
    summary = _check_run(proc, out)
    reports = [json.loads(p.read_text()) for p in flink.reports.glob("*.json")]
    assert any(r["pid"] == killed["pid"] and r["status"] == -9 for r in reports)  # it did die mid-job
    labelled = _by_id(_rows(out))  # (raises on a row written twice)
    assert set(labelled) == set(ids) and summary["labeled"] == len(ids) and summary["failed"] == 0
    ref = _direct_output(tmp_path, common, module="beam_prefix.pipelines.classify", what="labeled")
    _same_labels(_rows(out), _rows(ref))


def test_throughput_on_flink_for_the_sizing_figures(embedded_flink, tmp_path):
    """2,000 tickets, 2 worker processes on this machine's 2 vCPUs: the figures docs/scale.md's
    sizing section quotes (benchmarks/results/flink.json); every row labelled once."""
    flink = embedded_flink
    source, ids = csv_input(tmp_path, rows=2000, bad=False)
    out = f"{tmp_path}/flink/labeled"
    proc = flink.run([*flink.flags(), "--sdk_worker_parallelism=2", "--task=support_tickets_head",
                      f"--input={source}", "--id_column=ticket_id", f"--output={out}"],
                     name="classify, throughput", rows=len(ids), module="beam_prefix.pipelines.classify",
                     summary=f"{out}-summary.json")
    summary = _check_run(proc, out)
    assert set(_by_id(_rows(out))) == set(ids) and summary["labeled"] == len(ids)


def test_classify_on_a_standalone_flink_cluster(cluster_flink, tmp_path):
    flink = cluster_flink
    source, ids = csv_input(tmp_path)
    common = ["--task=support_tickets_head", f"--input={source}", "--id_column=ticket_id"]
    _, _, out, ref = _on_flink_and_direct(flink, tmp_path, common, module="beam_prefix.pipelines.classify",
                                          what="labeled", name="classify csv", rows=len(ids))
    _same_labels(_rows(out), _rows(ref))
    assert _failed(f"{tmp_path}/flink/failed") == _failed(f"{tmp_path}/direct/failed")
