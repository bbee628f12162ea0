"""The transformers baselines run with the installed transformers, whatever it names its
continuous-batching fields: `bench pressure --baseline hf` on the tiny model, also with a
ContinuousBatchingConfig that spells the page size `block_size` (as older releases did)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
import transformers
from tiny_models import tiny_model_path
from transformers.generation import configuration_utils

from kvserve.bench.hf import make_cb_config
from kvserve.cli import main

pytestmark = pytest.mark.slow  # the heavy tier (README: the two commands)

_CBC = configuration_utils.ContinuousBatchingConfig


class _OldCBC(_CBC):
    """A ContinuousBatchingConfig whose page size is `block_size` and has no `page_size`."""

    def __init__(self, block_size: int = 256, num_blocks: int | None = None,
                 max_batch_tokens: int | None = None) -> None:
        super().__init__(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    n = torch.get_num_threads()  # the benches set torch's global thread count
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def test_cb_config_maps_names_and_lists_what_it_drops() -> None:
    cfg, dropped = make_cb_config(_OldCBC, {"page_size": 4, "num_blocks": 9, "cpu_offload_space": 2.0})
    assert (cfg.page_size, cfg.num_blocks) == (4, 9)
    assert dropped == {"cpu_offload_space": 2.0}
    cfg, dropped = make_cb_config(_CBC, {"page_size": 8, "num_blocks": 3})
    assert (cfg.page_size, cfg.num_blocks, dropped) == (8, 3, {})


@pytest.mark.parametrize("old_names", [False, True])
def test_bench_pressure_hf_baseline_runs(tiny_path, tmp_path, capsys, keep_torch_threads,
                                         monkeypatch, old_names) -> None:
    if old_names:
        monkeypatch.setattr(configuration_utils, "ContinuousBatchingConfig", _OldCBC)
        monkeypatch.setattr(transformers, "ContinuousBatchingConfig", _OldCBC, raising=False)
    out = tmp_path / "p.json"
    assert main(["bench", "pressure", "--model", tiny_path, "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "8", "--block-size", "4", "--baseline", "hf", "--threads", "1",
                 "--no-progress", "--json", str(out)]) == 0
    hf = json.loads(out.read_text())["runs"]["hf_continuous"]
    assert "error" not in hf, hf
    assert hf["output_tokens"] == 4 * 8
    assert hf["match_unconstrained"]["identical"] == 4  # same greedy tokens as kvserve
    assert "not run" not in capsys.readouterr().out
