"""Shared fixtures: the default model loaded once per session (kvserve and transformers)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a Ray the tests start is loopback-only, as `kvserve serve` makes it (deploy/serve_cli.py);
# set before any test module imports ray, which reads it at import
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `own_ray_cluster` start a Ray cluster of their own, which cannot share
    this process with the session's Ray (`serve_app`): they run first, before any test
    starts that one (the sort is stable: the order is kept otherwise)."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray_cluster") is None)


@pytest.fixture(scope="session")
def smol_path() -> str:
    from kvserve.models import default_model

    return default_model()


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """transformers' own load of the default GGUF: the correctness oracle."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smol_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smol_llm(smol_path):
    """One kvserve LLM on the default model, shared by tests that leave it idle afterwards."""
    from kvserve import LLM

    return LLM(smol_path, kv_cache_tokens=16384)


@pytest.fixture(scope="session")
def smol_llm_exact(smol_path):
    """The default model with float32 activations (cpu_matmul exact): transformers' greedy
    tokens, where the default's 8-bit activations move some off their path."""
    from kvserve import LLM

    return LLM(smol_path, kv_cache_tokens=4096, cpu_matmul="exact", host_cache_gib=0)


# The session's Ray + Serve app (`serve_app`), started only by tests that use it.
from serve_fixtures import serve_app  # noqa: E402, F401
