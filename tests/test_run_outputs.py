"""A run writes only its own outputs (reliability, round 4): task names that would become
paths, outputs onto the model a run reads, two runs into one output, layers past the
model's depth, tuned weights replaced under their record, damaged head files, litter of
killed runs, CSV headers and inputs that are not regular files, tune's row checks, and
heads outside their task file's directory. Each test names the issue's item."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from beam_prefix import PrefixClassifier, TaskSpec, fit_head
from beam_prefix.errors import ModelLoadError, TaskSpecError
from beam_prefix.tasks.trained_head import TrainedHead
from beam_prefix.pipelines import classify, fit, tune
from beam_prefix.tasks.shipped import resolve_task

from conftest import ROOT, SUPPORT_TASK, TEXTS, tiny_task

SAMPLE = os.path.join(ROOT, "pipelines", "data", "sample_tickets.csv")
HEAD = os.path.join(os.path.dirname(SUPPORT_TASK), "support_tickets.head")


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("beam_prefix.model.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _exit_2(main, argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    """A copy of the tiny model directory, and the digest of each of its files."""
    m = tmp_path / "model"
    shutil.copytree(tiny_dir, m)
    return m, {p.name: _digest(p) for p in m.iterdir()}


def _tune_args(tiny_dir, tmp_path, *more):
    return ["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label", f"--model={tiny_dir}",
            "--epochs=1", "--folds=2", "--layers=1", "--pooling=mean", *more]


# -- 1: a task's name never becomes a path -------------------------------------------------

@pytest.mark.parametrize("name", ["/abs/dir/x", "../../x", "a/b", "..", ".hidden", "x" * 101, "ok name"])
def test_tune_refuses_a_task_name_that_is_not_a_file_name(name, tiny_dir, tmp_path, no_model, capsys):
    data = yaml.safe_load(open(resolve_task("support_tickets"), encoding="utf-8")) | {"name": name}
    task = tmp_path / "t.yaml"
    task.write_text(yaml.safe_dump(data))
    err = _exit_2(tune.main, [f"--task={task}", *_tune_args(tiny_dir, tmp_path, f"--output={tmp_path}/out")[1:]],
                  capsys)
    assert "is not a file name" in err and repr(name) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml"]  # nothing written, anywhere near


def test_file_name_of_keeps_plain_names():
    from beam_prefix.tasks.task_file import file_name_of

    assert file_name_of("banking77_fast_head") == "banking77_fast_head"
    assert file_name_of("v1.2-support") == "v1.2-support"
    with pytest.raises(TaskSpecError, match="not a file name"):
        file_name_of("a..b")


# -- 2: no run writes into the model it reads ----------------------------------------------

def test_classify_summary_onto_the_models_config_is_refused(model_copy, tmp_path, no_model, capsys):
    m, before = model_copy
    err = _exit_2(classify.main, ["--runner=DirectRunner", f"--model={m}", f"--input={SAMPLE}",
                                  f"--output={tmp_path}/o/labeled", f"--summary_output={m}/config.json"], capsys)
    assert "--summary_output=" in err and "--model=" in err and "config.json" in err
    assert {p.name: _digest(p) for p in m.iterdir()} == before


def test_fit_output_onto_the_models_weights_is_refused(model_copy, no_model, capsys):
    m, before = model_copy
    err = _exit_2(fit.main, ["--runner=DirectRunner", f"--model={m}", f"--input={SAMPLE}", "--label_column=label",
                             f"--output={m}/model.safetensors"], capsys)
    assert "--output=" in err and "--model=" in err and "model.safetensors" in err
    assert {p.name: _digest(p) for p in m.iterdir()} == before


def test_a_model_file_that_does_not_exist_yet_is_refused_too(model_copy, no_model, capsys):
    """A file the loader would read next time (a tokenizer file, a tuning record) is the
    model's even before it exists."""
    m, before = model_copy
    err = _exit_2(fit.main, ["--runner=DirectRunner", f"--model={m}", f"--input={SAMPLE}", "--label_column=label",
                             f"--output={m}/tokenizer.model"], capsys)
    assert "reads as a model file" in err
    err = _exit_2(fit.main, ["--runner=DirectRunner", f"--model={m}", f"--input={SAMPLE}", "--label_column=label",
                             f"--output={m}/x.head", f"--summary_output={m}/beam_prefix_tuning.json"], capsys)
    assert "--summary_output=" in err
    assert {p.name: _digest(p) for p in m.iterdir()} == before


def test_tune_summary_onto_the_models_config_is_refused(model_copy, tmp_path, no_model, capsys):
    m, before = model_copy
    err = _exit_2(tune.main, _tune_args(m, tmp_path, f"--output={tmp_path}/out", f"--summary_output={m}/config.json"),
                  capsys)
    assert "--summary_output=" in err and "--model=" in err
    assert {p.name: _digest(p) for p in m.iterdir()} == before


def test_heads_beside_a_model_are_not_the_models_files(model_copy):
    """A fit into a tuned directory may write (or replace) a head there: heads and task
    files are not what a model loader reads."""
    from beam_prefix.pipelines.launch_checks import model_reads, refuse_overlap
    from beam_prefix.pipelines.publish import Output

    m, _ = model_copy
    (m / "old.head").write_bytes(b"x")
    refuse_overlap([Output("--output", str(m / "old.head")), Output("--summary_output", str(m / "fit.json"))],
                   model_reads(str(m)))


def test_the_embedded_models_directory_is_protected_without_converting_it(monkeypatch, tmp_path):
    from beam_prefix.model import loading
    from beam_prefix.pipelines.launch_checks import model_reads, refuse_overlap
    from beam_prefix.pipelines.publish import Output, OutputLocationError

    monkeypatch.setenv("BEAM_PREFIX_CACHE", str(tmp_path / "cache"))
    directory = loading.embedded_cache_directory()
    with pytest.raises(OutputLocationError, match="model file"):
        refuse_overlap([Output("--summary_output", os.path.join(directory, "config.json"))], model_reads("embedded"))
    assert not (tmp_path / "cache").exists()  # nothing converted, nothing created


# -- 3: two runs into one output -----------------------------------------------------------

_HOLD = """
import sys, time
from beam_prefix.pipelines.output_lock import locked
with locked([("--output", sys.argv[1])]):
    print("held", flush=True)
    time.sleep(120)
"""


def _holder(output: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, output], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_an_output_being_written_is_refused_and_a_killed_holder_frees_it(tmp_path, no_model, capsys):
    out = f"{tmp_path}/o/labeled"
    holder = _holder(out)
    try:
        err = _exit_2(classify.main, ["--runner=DirectRunner", f"--input={SAMPLE}", f"--output={out}"], capsys)
        assert "--output=" in err and f"run {holder.pid} on" in err and "wait for it to end" in err
        assert not any(n.startswith(".beam-prefix-staging") for n in os.listdir(tmp_path / "o"))  # nothing staged
    finally:
        holder.kill()  # kill -9: no clean-up of its own
        holder.wait()
    from beam_prefix.pipelines.output_lock import lock_path, locked

    assert os.path.exists(lock_path(out))  # left behind by the killed holder, but not held:
    with locked([("--output", out)]):
        pass
    assert not os.path.exists(lock_path(out))  # the next holder removes it


def test_fit_and_tune_lock_their_outputs(tmp_path, tiny_dir, no_model, capsys):
    head = f"{tmp_path}/h/support.head"
    holder = _holder(head)
    try:
        err = _exit_2(fit.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label",
                                 f"--model={tiny_dir}", f"--output={head}"], capsys)
        assert "is being written by" in err
    finally:
        holder.kill()
        holder.wait()
    holder = _holder(f"{tmp_path}/tuned")
    try:
        err = _exit_2(tune.main, _tune_args(tiny_dir, tmp_path, f"--output={tmp_path}/tuned"), capsys)
        assert "is being written by" in err and "--output=" in err
    finally:
        holder.kill()
        holder.wait()


def test_a_remote_lease_refuses_a_live_holder_and_expires_with_a_dead_one(tmp_path):
    """The lease object stores get (tried on a local path through Beam's FileSystems, as it
    runs on gs://): held while renewed, taken once it expires."""
    from beam_prefix.pipelines.output_lock import Lease, OutputLockedError

    path = str(tmp_path / ".beam-prefix-lock-x")
    first = Lease(path, flag="--output", output="gs://b/x", lease_s=0.6)
    first.acquire()
    try:
        time.sleep(0.8)  # past one lease: the holder renewed it
        with pytest.raises(OutputLockedError, match="is being written by"):
            Lease(path, flag="--output", output="gs://b/x", lease_s=0.6).acquire()
    finally:
        first._stop.set()  # dies without releasing: its lease is left to expire
        first._renewer.join()
    time.sleep(0.7)
    second = Lease(path, flag="--output", output="gs://b/x", lease_s=0.6)
    second.acquire()
    second.release()
    assert not os.path.exists(path)


# -- 4, 5: layers past the model's depth ---------------------------------------------------

@pytest.mark.parametrize("layers", [(4,), (5,), (9,), (-5,), (-1, 3), (0, -4)])
def test_the_library_refuses_layers_the_model_lacks_on_every_path(tiny_models, layers):
    """The tiny Llama has 3 layers: hidden states -4..3. Beyond them an index used to wrap
    around to another layer's states (or raise an IndexError); two names of one state read
    it twice."""
    from beam_prefix.model.early_exit import check_layers

    clf = PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False)
    message = "out of range" if any(not -4 <= i <= 3 for i in layers) else "name the same hidden state"
    with pytest.raises(TaskSpecError, match=message):
        clf.embed(TEXTS[:2], layers=layers)
    with pytest.raises(TaskSpecError, match=message):
        clf.embed_full(TEXTS[:2], layers=layers)
    with pytest.raises(TaskSpecError, match=message):
        fit_head(clf, TEXTS[:6], ["billing", "technical", "account"] * 2, layers=layers, folds=2)
    with pytest.raises(TaskSpecError, match=message):
        check_layers(clf.model.config, layers)


def test_the_last_layer_by_either_name_is_the_same_features(tiny_models):
    clf = PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False)
    a, b = clf.embed(TEXTS[:2], layers=(-1,)), clf.embed(TEXTS[:2], layers=(3,))
    assert all(torch.equal(torch.as_tensor(x.features), torch.as_tensor(y.features)) for x, y in zip(a, b))


def test_embed_text_refuses_layers_the_model_lacks_at_launch(tiny_dir):
    from beam_prefix.beam.embed_transform import EmbedText

    with pytest.raises(TaskSpecError, match=r"\[4\] out of range"):
        EmbedText(task=tiny_task(), layers=(4,), model=tiny_dir).config.check_fits()


@pytest.mark.parametrize("layers, says", [("0", "token embeddings"), ("-4", "token embeddings"),
                                          ("4", "[4] out of range"), ("-5", "[-5] out of range"),
                                          ("-1,3", "name the same hidden state")])
def test_tune_checks_its_layers_at_launch(layers, says, tiny_dir, tmp_path, no_model, capsys):
    args = [a for a in _tune_args(tiny_dir, tmp_path, f"--output={tmp_path}/out") if not a.startswith("--layers")]
    err = _exit_2(tune.main, [*args, "--layers", layers], capsys)
    assert says in err and "--layers" in err
    assert not (tmp_path / "out").exists()


def test_fit_refuses_two_names_of_one_state(tiny_dir, tmp_path, no_model, capsys):
    err = _exit_2(fit.main, ["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label",
                             f"--model={tiny_dir}", f"--output={tmp_path}/h.head", "--layers=-1,3"], capsys)
    assert "name the same hidden state" in err


def test_tuning_refuses_to_tune_the_token_embeddings(tiny_models):
    from beam_prefix.engines.model_tuning import tuned_modules

    with pytest.raises(TaskSpecError, match="token embeddings"):
        tuned_modules(tiny_models["llama"].model, (0,))
    assert tuned_modules(tiny_models["llama"].model, (0, 1))[1] == 1


# -- 6: a tuned model's id covers its weights ----------------------------------------------

def test_a_tuned_directory_whose_weights_were_replaced_is_refused(tiny_dir, tmp_path):
    from beam_prefix.engines.model_tuning import tune_model
    from beam_prefix.model.loading import load_model, model_id
    from beam_prefix.model.tuning_record import read_record

    out = tmp_path / "tuned"
    texts = TEXTS * 2
    record = tune_model(tiny_task(), texts, [("billing", "technical", "account")[i % 3] for i in range(len(texts))],
                        output_dir=str(out), model=tiny_dir, layers=(1,), pooling="mean", epochs=1,
                        learning_rate=1e-2)
    assert record.weights_digest and read_record(str(out)) == record and model_id(str(out)) == record.id
    assert record.files_digest  # #61.4: the configuration and tokenizer too
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine)
    shutil.copy(os.path.join(tiny_dir, "model.safetensors"), out / "model.safetensors")  # the base weights
    with pytest.raises(ModelLoadError, match="weight files are not the ones"):
        model_id(str(out))
    with pytest.raises(ModelLoadError, match="weight files are not the ones"):
        load_model(str(out))
    # #61.4: a changed config (rope_theta, rms_norm_eps) changed 3 of 5 labels under the same id
    for name, change in [("config.json", lambda c: c | {"rope_theta": 1234.0, "rms_norm_eps": 0.01}),
                         ("generation_config.json", lambda c: c | {"eos_token_id": 7}),
                         ("tokenizer_config.json", lambda c: c | {"model_max_length": 77})]:
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
        assert model_id(str(out)) == record.id
        config = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps(change(config)))
        with pytest.raises(ModelLoadError, match="configuration or tokenizer files .* are not the ones"):
            model_id(str(out))
        with pytest.raises(ModelLoadError, match="configuration or tokenizer files"):
            load_model(str(out))
    shutil.rmtree(out)
    shutil.copytree(pristine, out)
    (out / "chat_template.jinja").write_text("{{ messages }}")  # a file added changes the prompt too
    with pytest.raises(ModelLoadError, match="configuration or tokenizer files"):
        model_id(str(out))


# -- 7, 8: damaged head files --------------------------------------------------------------

def _rewrite_head(tmp_path, change, head: str = HEAD) -> str:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(head, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    change(meta, tensors)
    path = str(tmp_path / "damaged.head")
    save_file(tensors, path, metadata=meta)
    return path


@pytest.mark.parametrize("hashes, says", [(lambda h: h.double(), "1-D int64 tensor, got a 1-D float64"),
                                          (lambda h: h.reshape(-1, 2), "1-D int64 tensor, got a 2-D int64")])
def test_a_head_whose_train_hashes_are_not_1d_int64_is_damaged(tmp_path, hashes, says):
    path = _rewrite_head(tmp_path, lambda meta, t: t.update(train_hashes=hashes(t["train_hashes"])))
    with pytest.raises(TaskSpecError, match=f"head file .*damaged.*{says}"):
        TrainedHead.load(path)


def _set_alpha(meta, value):
    import json

    from beam_prefix.tasks.trained_head import HEAD_METADATA_KEY

    data = json.loads(meta[HEAD_METADATA_KEY])
    data["lexical_alpha"] = value
    meta[HEAD_METADATA_KEY] = json.dumps(data)


@pytest.mark.parametrize("change, says", [
    (lambda meta, t: t["lexical_word_idf"].__setitem__(0, 3e38), "lexical_word_idf holds values outside"),
    (lambda meta, t: t["lexical_char_idf"].__setitem__(0, -1.0), "lexical_char_idf holds values outside"),
    (lambda meta, t: t["lexical_bias"].__setitem__(0, 1e30), "lexical_bias holds values outside"),
    (lambda meta, t: _set_alpha(meta, 1e300), "lexical alpha must be in"),
])
def test_a_head_with_out_of_bounds_ngram_parts_is_refused_at_load(tmp_path, change, says):
    with_ngrams = os.path.join(os.path.dirname(SUPPORT_TASK), "banking77_fast.head")
    assert TrainedHead.load(_rewrite_head(tmp_path, lambda meta, t: None, with_ngrams)).lexical is not None
    with pytest.raises(TaskSpecError, match=f"damaged.head.*{says}"):
        TrainedHead.load(_rewrite_head(tmp_path, change, with_ngrams))


def test_the_non_finite_score_message_names_what_is_wrong():
    from beam_prefix.engines.classifier import _what_is_not_finite

    assert "1 of its 3 raw scores are NaN or infinite (1 NaN)" in _what_is_not_finite(torch.tensor([1.0, float("nan"), 2]))
    assert "finite (largest magnitude 3e+38)" in _what_is_not_finite(torch.tensor([3e38, -3e38, 0.0]))


# -- 9: what a killed run leaves -----------------------------------------------------------

def test_a_run_removes_the_staging_an_earlier_killed_run_into_the_same_output_left(tmp_path, tiny_dir, capsys):
    out = tmp_path / "o"
    stale = out / ".beam-prefix-staging-labeled-20260101-000000-deadbeef"
    (stale / "beam-temp-labeled-1").mkdir(parents=True)
    (stale / "beam-temp-labeled-1" / "part").write_text("x")
    other = out / ".beam-prefix-staging-labeled-b-20260101-000000-deadbeef"  # another output's: kept
    other.mkdir()
    assert classify.main(["--runner=DirectRunner", f"--model={tiny_dir}", f"--input={SAMPLE}", "--verify=false",
                          f"--output={out}/labeled"]) == 0
    names = sorted(os.listdir(out))
    assert other.name in names and stale.name not in names
    assert not [n for n in names if n.startswith(".beam-prefix-staging-labeled-2")]  # its own went too
    assert not [n for n in names if n.startswith(".beam-prefix-lock")]


def test_tune_removes_what_a_killed_tuning_into_the_same_output_left(tiny_dir, tmp_path, capsys):
    left = tmp_path / ".tuned.tuning" / "model"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"x" * 1000)
    assert tune.main(_tune_args(tiny_dir, tmp_path, f"--output={tmp_path}/tuned")) == 0
    assert sorted(os.listdir(tmp_path)) == ["tuned"]


def _wait_for(predicate, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path, tiny_dir):
    """SIGTERM mid-run: exit 143 with one line, nothing published, no staging, no lock, and
    not the output folder the run made."""
    rows = tmp_path / "many.csv"
    rows.write_text("text\n" + "".join(f"ticket {i}: my card was charged twice\n" for i in range(20000)))
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.classify", "--runner=DirectRunner",
                             f"--model={tiny_dir}", f"--input={rows}", f"--output={out}/labeled", "--verify=false"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: out.exists() and any(n.startswith(".beam-prefix-staging") for n in os.listdir(out)), 120, proc)
    time.sleep(3)  # into the run
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "error: terminated (SIGTERM); nothing was published" in err
    assert not out.exists()  # the folder the run made for its output, left empty, is gone too


# -- 10: tune's summary inside its output --------------------------------------------------

@pytest.mark.parametrize("summary", ["{out}", "{out}/summary.json"])
def test_tune_refuses_a_summary_in_its_output_directory(summary, tiny_dir, tmp_path, no_model, capsys):
    out = f"{tmp_path}/tuned"
    err = _exit_2(tune.main, _tune_args(tiny_dir, tmp_path, f"--output={out}",
                                        f"--summary_output={summary.format(out=out)}"), capsys)
    assert "lies in --output=" in err
    assert os.listdir(tmp_path) == []


# -- 11, 12: CSV headers and inputs that are not regular files -----------------------------

@pytest.mark.parametrize("header", ["id,text,text,label", "id,text,id,label"])
def test_a_csv_header_naming_a_column_twice_is_refused_at_launch(header, tmp_path, no_model, capsys):
    path = tmp_path / "in.csv"
    path.write_text(header + "\n1,a,b,billing\n")
    twice = "text" if header.count("text") == 2 else "id"
    for main, more in ((classify.main, [f"--output={tmp_path}/o/x"]),
                       (fit.main, ["--label_column=label", f"--output={tmp_path}/h.head"])):
        err = _exit_2(main, ["--runner=DirectRunner", f"--input={path}", *more], capsys)
        assert "more than once" in err and repr(twice) in err


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "rows.csv"
    os.mkfifo(path)
    return path


def test_inputs_that_are_not_regular_files_are_refused_at_launch(tmp_path, fifo, tiny_dir, no_model, capsys):
    zero = tmp_path / "zero.csv"
    zero.symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO"), (zero, "a device"), ("/dev/zero", "a device")):
        err = _exit_2(classify.main, ["--runner=DirectRunner", f"--input={path}", "--input_format=csv",
                                      f"--output={tmp_path}/o/x"], capsys)
        assert kind in err and "--input" in err
        err = _exit_2(fit.main, ["--runner=DirectRunner", f"--input={path}", "--input_format=csv",
                                 "--label_column=label", f"--output={tmp_path}/h.head"], capsys)
        assert kind in err
        err = _exit_2(tune.main, [*_tune_args(tiny_dir, tmp_path, f"--output={tmp_path}/out", "--input_format=csv"),
                                  f"--input={path}"], capsys)
        assert kind in err
    glob_err = _exit_2(classify.main, ["--runner=DirectRunner", f"--input={tmp_path}/*.csv", "--input_format=csv",
                                       f"--output={tmp_path}/o/x"], capsys)
    assert "not" in glob_err or "a FIFO" in glob_err or "a device" in glob_err


def test_a_csv_header_read_is_bounded(tmp_path, no_model, capsys):
    path = tmp_path / "one_line.csv"
    path.write_bytes(b"a" * (2 << 20))  # 2 MB and no line break
    err = _exit_2(classify.main, ["--runner=DirectRunner", f"--input={path}", f"--output={tmp_path}/o/x"], capsys)
    assert "no CSV header line within" in err


# -- 13: tune reads rows as classify does --------------------------------------------------

def test_tune_refuses_rows_classify_would_fail(tiny_dir, tmp_path, no_model, capsys):
    rows = tmp_path / "rows.csv"
    rows.write_text("text,label\nmy invoice is wrong,billing\n\"   \",technical\n\"\t\n\",account\nlocked out,\n")
    args = [a for a in _tune_args(tiny_dir, tmp_path, f"--output={tmp_path}/out") if not a.startswith("--input")]
    err = _exit_2(tune.main, [*args, f"--input={rows}"], capsys)
    assert "3 of 4 input rows cannot train" in err and "2 empty_text" in err and "1 no_label" in err


# -- 14: no abort after a correct error ----------------------------------------------------

def test_fit_exits_2_not_an_abort_when_a_labels_rows_all_fail(tmp_path, tiny_dir):
    rows = tmp_path / "rows.csv"
    text = open(SAMPLE, encoding="utf-8").read().splitlines()
    header, body = text[0], text[1:]
    cols = header.split(",")
    kept = [line for line in body if not line.rstrip().endswith(",account")]
    failing = ",".join("" if c == "text" else ("T" if c != "label" else "account") for c in cols)
    rows.write_text("\n".join([header, *kept, failing, failing]) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pipelines.fit", "--runner=DirectRunner", f"--model={tiny_dir}",
                           f"--input={rows}", "--label_column=label", f"--output={tmp_path}/h.head", "--verify=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "labels with no training row" in proc.stderr and "terminate called" not in proc.stderr


# -- 15: a task's head lies beside it ------------------------------------------------------

@pytest.mark.parametrize("head", ["../../../../etc/passwd", "/etc/passwd", "sub/../../x.head", "link.head"])
def test_a_task_files_head_outside_its_directory_is_refused_unread(head, tmp_path, monkeypatch):
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "link.head").symlink_to("/etc/passwd")
    text = open(SUPPORT_TASK, encoding="utf-8").read().replace("scoring: auto", f"scoring: head\nhead: {head}")
    (d / "t.yaml").write_text(text)
    monkeypatch.setattr(TrainedHead, "load", classmethod(lambda cls, p: pytest.fail(f"{p} was opened")))
    with pytest.raises(TaskSpecError, match="outside the task file's directory"):
        TaskSpec.from_yaml(d / "t.yaml")


def test_a_head_in_a_folder_below_the_task_file_loads(tmp_path):
    d = tmp_path / "tasks"
    (d / "heads").mkdir(parents=True)
    shutil.copy(HEAD, d / "heads" / "support.head")
    text = open(os.path.join(os.path.dirname(SUPPORT_TASK), "support_tickets_head.yaml"), encoding="utf-8").read()
    text = text.replace("head: support_tickets.head", "head: heads/support.head")
    (d / "t.yaml").write_text(text)
    assert TaskSpec.from_yaml(d / "t.yaml").head.source == str(d / "heads" / "support.head")
