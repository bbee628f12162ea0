"""`--speculative-config` with vLLM's names: parsed the same from the offline CLI, `kvserve
serve`, ServeConfig and EngineConfig; what kvserve cannot honour is a clear error."""

from __future__ import annotations

import pytest

from kvserve.config import EngineConfig
from kvserve.errors import ConfigError
from kvserve.speculative import SpeculativeConfig, parse_speculative_config


def test_vllm_names_and_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                 '"prompt_lookup_max": 4, "disable_by_batch_size": 16}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max,
            c.disable_by_batch_size) == ("ngram", 4, 2, 4, 16)
    # method follows from `model` when left out, as in vLLM
    d = parse_speculative_config({"model": "/models/draft", "num_speculative_tokens": 3})
    assert d.method == "draft_model" and d.model == "/models/draft"
    assert parse_speculative_config({"num_speculative_tokens": 2}).method == "ngram"
    assert parse_speculative_config("null") is None and parse_speculative_config(None) is None
    # a lone bound moves the other one's default out of its way
    assert parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 7}
                                    ).prompt_lookup_max == 7
    assert parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 1}
                                    ).prompt_lookup_min == 1


@pytest.mark.parametrize("value, message", [
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method: Input should be 'ngram' or "
                                                       "'draft_model'"),
    ({"method": "ngram"}, "num_speculative_tokens: Field required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens: Input should be greater than"),
    ({"num_speculative_tokens": 99}, "num_speculative_tokens: Input should be less than"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes no `model`"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "belong to method "
                                                                          "'ngram'"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "must not exceed"),
    # a vLLM field kvserve does not implement is refused, not ignored
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "unknown field 'draft_tensor_parallel_size'"),
])
def test_bad_configs_are_refused_with_the_reason(value, message):
    with pytest.raises(ValueError, match="speculative config") as err:
        parse_speculative_config(value)
    assert message in str(err.value)


def test_engine_config_refuses_what_it_cannot_honour():
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    cfg = EngineConfig(speculative_config=spec, device="cpu")
    assert isinstance(cfg.speculative_config, SpeculativeConfig)
    assert cfg.resolved_async_scheduling() is False  # proposals need the host's tokens
    with pytest.raises(ValueError, match="async_scheduling is not available with speculative"):
        EngineConfig(speculative_config=spec, async_scheduling=True)
    with pytest.raises(ValueError, match="'draft_model' is not available with "
                                         "tensor_parallel_size > 1"):
        EngineConfig(speculative_config={"model": "x", "num_speculative_tokens": 2},
                     tensor_parallel_size=2)
    with pytest.raises(ValueError, match="not available with LoRA adapters"):
        EngineConfig(speculative_config=spec, enable_lora=True)


def test_serve_cli_and_serve_config_carry_it_to_the_workers():
    from kvserve.cli import build_parser
    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import config_from_args

    a = build_parser().parse_args(["serve", "--speculative-config",
                                   '{"method": "ngram", "num_speculative_tokens": 5}'])
    engine = config_from_args(a).router_config().worker_engine(8)
    # what each worker builds its engine from
    got = EngineConfig(**engine).speculative_config
    assert got is not None and (got.method, got.num_speculative_tokens) == ("ngram", 5)
    with pytest.raises(ConfigError, match="speculative config is not valid JSON"):
        config_from_args(build_parser().parse_args(["serve", "--speculative-config", "{"]))
    with pytest.raises(ValueError, match="engine.speculative_config differs"):
        ServeConfig(speculative_config={"num_speculative_tokens": 2},
                    engine={"speculative_config": {"num_speculative_tokens": 3}})
    assert ServeConfig().engine_config().speculative_config is None


def test_offline_cli_takes_it():
    from kvserve.cli import _settings, build_parser

    a = build_parser().parse_args(["generate", "--prompt", "x", "--speculative-config",
                                   '{"num_speculative_tokens": 2}'])
    cfg = EngineConfig(**_settings(a))
    assert cfg.speculative_config is not None and cfg.speculative_config.method == "ngram"
