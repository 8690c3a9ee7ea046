"""The embedded model for workers that lack it (#62.2): a --setup_file worker has the package,
not the model. The launcher stages its converted copy under --temp_location; a worker with no
copy of its own fetches it from there, every file checked, and answers as the embedded model."""

from __future__ import annotations

import json
import os

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.errors import ModelLoadError
from beam_prefix.model import loading
from beam_prefix.model.embedded_staging import MANIFEST, fetch_staged, stage_embedded, staged_location, staged_spec
from beam_prefix.pipelines.model_staging import stage_for_workers, workers_elsewhere


def _no_embedded_here(monkeypatch, tmp_path):
    """This process as a --setup_file worker: an empty model cache and no GGUF file."""
    monkeypatch.setenv("BEAM_PREFIX_CACHE", str(tmp_path / "worker-cache"))
    monkeypatch.setattr(loading, "shared_gguf_path", lambda: str(tmp_path / "no-such.gguf"))
    assert loading.importlib.util.find_spec(loading.EMBEDDED_PACKAGE) is None  # (the Makefile copies the file)


def test_a_worker_without_the_model_loads_the_staged_copy_as_the_embedded_model(tmp_path, monkeypatch):
    local = loading.embedded_directory()  # the launcher's converted copy
    folder = stage_embedded(local, str(tmp_path / "temp" / "beam-prefix"))
    assert stage_embedded(local, str(tmp_path / "temp" / "beam-prefix")) == folder  # once per version
    assert json.load(open(os.path.join(folder, MANIFEST)))["model.safetensors"]["bytes"] > 100 << 20
    _no_embedded_here(monkeypatch, tmp_path)
    with pytest.raises(ModelLoadError, match="give the CLIs --temp_location"):
        loading.load_tokenizer("embedded")  # a worker with neither: what to do
    spec = staged_spec(folder)
    assert staged_location(spec) == folder and loading.model_id(spec) == loading.model_id("embedded")
    tokenizer = loading.load_tokenizer(spec)  # fetched into the worker's own cache, then read there
    assert tokenizer("billing")["input_ids"]
    assert loading.embedded_directory(spec) == loading.embedded_cache_directory()
    assert loading.embedded_cache_directory().startswith(str(tmp_path / "worker-cache"))


def test_a_staged_file_that_is_not_its_manifests_is_refused(tmp_path, monkeypatch):
    folder = stage_embedded(loading.embedded_directory(), str(tmp_path / "temp"))
    with open(os.path.join(folder, "config.json"), "a") as f:
        f.write(" ")
    _no_embedded_here(monkeypatch, tmp_path)
    with pytest.raises(ModelLoadError, match="config.json is not the file its manifest names"):
        fetch_staged(folder, loading.embedded_cache_directory())
    assert not os.path.exists(loading.embedded_cache_directory())  # nothing half-copied
    os.remove(os.path.join(folder, MANIFEST))
    with pytest.raises(ModelLoadError, match="holds no staged copy"):
        fetch_staged(folder, loading.embedded_cache_directory())


@pytest.mark.parametrize("flags, elsewhere", [
    ([], False), (["--runner=DirectRunner"], False),
    (["--runner=PortableRunner", "--job_endpoint=embed"], False),
    (["--runner=PortableRunner", "--job_endpoint=localhost:8099", "--environment_type=LOOPBACK"], False),
    (["--runner=PortableRunner", "--job_endpoint=localhost:8099", "--environment_type=PROCESS"], True),
    (["--runner=FlinkRunner"], True), (["--runner=DataflowRunner"], True),
])
def test_staging_is_for_runners_whose_workers_are_elsewhere(flags, elsewhere, tmp_path):
    options = PipelineOptions(flags + [f"--temp_location={tmp_path}/t"])
    assert workers_elsewhere(options) is elsewhere
    spec = stage_for_workers(options, ["embedded"])
    assert (spec is not None) is elsewhere
    if spec:
        assert staged_location(spec).startswith(f"{tmp_path}/t/beam-prefix/beam-prefix-embedded-")
    assert stage_for_workers(options, ["/models/other"]) is None  # only the embedded model is staged
    assert stage_for_workers(PipelineOptions(flags + ["--stage_model=false", f"--temp_location={tmp_path}/t"]),
                             ["embedded"]) is None
    with pytest.raises(ValueError, match="--stage_model true stages the embedded model under --temp_location"):
        stage_for_workers(PipelineOptions(flags + ["--stage_model=true"]), ["embedded"])
