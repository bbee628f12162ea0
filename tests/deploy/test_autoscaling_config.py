"""Autoscaling's settings: ServeConfig's `autoscaling` block, the `kvserve serve` flags, a bad
setting refused before anything starts, the placement check sized for max_workers, the
router configuration a redeploy compares, the retry time of a refusal; and the `autoscaling`
block of a fixed pool's server info (the session's app)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from pydantic import ValidationError

from kvserve.cli import build_parser, main
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.errors import ServiceError
from kvserve.deploy.openai_api import error_response
from kvserve.deploy.placement import Node, demand_of, unplaceable
from kvserve.deploy.serve_cli import config_from_args
from kvserve.errors import ConfigError


def _cfg(*flags: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", "--gpus-per-worker", "0",
                                                       *flags]))


def test_off_by_default_and_a_fixed_pool_as_before():
    cfg = _cfg()
    assert cfg.autoscaling is None and cfg.num_workers == 1
    assert cfg.router_config().autoscaling == {}
    assert _cfg("--workers", "3").num_workers == 3


def test_the_flags_make_the_block():
    cfg = _cfg("--min-workers", "0", "--max-workers", "4", "--upscale-delay-s", "5",
               "--downscale-delay-s", "60", "--downscale-to-zero-delay-s", "900",
               "--autoscale-max-step", "2", "--upscale-kv-use", "0.95", "--downscale-kv-use",
               "0.4", "--upscale-waiting", "8", "--upscale-ttft-s", "2.5", "--ttft-window-s",
               "60", "--max-queued-requests", "32", "--queue-timeout-s", "300")
    a = cfg.autoscaling
    assert (a.min_workers, a.max_workers, a.upscale_delay_s, a.downscale_delay_s) == (0, 4, 5, 60)
    assert (a.downscale_to_zero_delay_s, a.max_step, a.upscale_kv_use, a.downscale_kv_use) == (
        900, 2, 0.95, 0.4)
    assert (a.upscale_waiting, a.upscale_ttft_s, a.ttft_window_s) == (8, 2.5, 60)
    assert (a.max_queued_requests, a.queue_timeout_s) == (32, 300)
    assert cfg.num_workers == 1  # starts at max(1, min_workers)
    rc = cfg.router_config().autoscaling
    assert rc["enabled"] and rc["min_workers"] == 0 and rc["max_step"] == 2
    # the defaults: one worker kept; --max-workers alone keeps the minimum at one
    cfg = _cfg("--max-workers", "3")
    assert (cfg.autoscaling.min_workers, cfg.autoscaling.max_workers, cfg.num_workers) == (1, 3, 1)
    assert (cfg.autoscaling.upscale_delay_s, cfg.autoscaling.downscale_delay_s) == (30, 600)
    # --min-workers alone: at most the larger of it and --workers
    assert _cfg("--min-workers", "2").autoscaling.max_workers == 2
    cfg = _cfg("--min-workers", "0", "--workers", "2")
    assert (cfg.autoscaling.max_workers, cfg.num_workers) == (2, 2)
    # a ServeConfig round trip (the ingress gets it so) names the same router
    again = ServeConfig(**cfg.model_dump())
    assert again.router_config().digest() == cfg.router_config().digest()


@pytest.mark.parametrize("flags, message", [
    (["--min-workers", "3", "--max-workers", "2"],
     "autoscaling: min_workers (3) must not exceed max_workers (2)"),
    (["--min-workers", "-1", "--max-workers", "2"], "min_workers must be >= 0"),
    (["--max-workers", "4", "--workers", "5"],
     "num_workers (5) is the worker count autoscaling starts with: it must be within "
     "[max(1, min_workers), max_workers] = [1, 4]"),
    (["--min-workers", "2", "--max-workers", "4", "--workers", "1"], "= [2, 4]"),
    (["--upscale-delay-s", "5"],
     "--upscale-delay-s tunes autoscaling, which is off: set --min-workers and/or --max-workers"),
    (["--max-workers", "2", "--upscale-kv-use", "0.4"],
     "0 < downscale_kv_use < upscale_kv_use <= 1, got 0.5 and 0.4"),
    (["--max-workers", "2", "--queue-timeout-s", "0"], "queue_timeout_s must be > 0"),
])
def test_a_bad_setting_is_refused_before_anything_starts(flags, message, capsys):
    with pytest.raises(ConfigError) as e:
        _cfg(*flags)
    assert message in str(e.value)
    # the command: status 2 and one line, before Ray or the model (neither is started)
    assert main(["serve", "--gpus-per-worker", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_bad_block_in_serve_config_names_its_field():
    with pytest.raises(ValidationError, match="min_workers"):
        ServeConfig(autoscaling={"min_workers": 5, "max_workers": 2})
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        ServeConfig(autoscaling={"max_worker": 2})


def test_placement_is_checked_for_the_most_workers():
    cfg = ServeConfig(autoscaling={"min_workers": 0, "max_workers": 3})
    d = demand_of(cfg)
    assert d.num_workers == 3 and d.count_flag == "--max-workers"
    why = unplaceable(d, [Node("127.0.0.1", {"CPU": 2.0})])
    assert "3 workers need {CPU: 1} each, and the nodes hold 2 at once" in why
    assert "Ways out: --max-workers 2;" in why
    assert demand_of(ServeConfig(num_workers=2)).count_flag == "--workers"


def test_a_changed_autoscaling_block_keeps_the_router():
    a = ServeConfig(autoscaling={"max_workers": 2}).router_config()
    b = ServeConfig(autoscaling={"max_workers": 4, "upscale_delay_s": 5}).router_config()
    c = ServeConfig(num_workers=2).router_config()
    assert a.digest() != b.digest() and a.shape_digest() == b.shape_digest() == c.shape_digest()
    # thread share on CPU: as the largest pool would have it
    assert b.worker_engine(8)["num_threads"] == 2 and c.worker_engine(8)["num_threads"] == 4


def test_a_refusal_with_a_retry_time():
    e = ServiceError("unavailable", "no worker is serving yet", retry_after=7)
    r = error_response(e)
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert json.loads(r.body)["error"]["message"] == "no worker is serving yet"
    import pickle

    again = pickle.loads(pickle.dumps(e))  # (Ray ships it from the replica)
    assert again.retry_after == 7 and again.kind == "unavailable"
    assert "retry-after" not in error_response(ServiceError("unavailable", "x")).headers


def test_a_fixed_pool_shows_its_autoscaling_block(serve_app):
    import grpc

    from kvserve.protos import kvserve_pb2 as pb
    from kvserve.protos import kvserve_pb2_grpc

    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        info = kvserve_pb2_grpc.KVServeStub(ch).GetServerInfo(
            pb.GetServerInfoRequest(), metadata=serve_app.metadata, timeout=60)
    a = info.autoscaling
    assert not a.enabled and a.desired_workers == a.serving_workers == 2
    assert a.min_workers == a.max_workers == 2
    assert a.starting_workers == a.draining_workers == a.queued_requests == 0
    assert dict(a.decisions) == {} and not a.cold_starts
    assert 0 <= a.signals["kv_use"] <= 1 and "waiting" in a.signals
    req = urllib.request.Request(serve_app.http_url + "/v1/server_info",
                                 headers={"authorization": f"Bearer {serve_app.api_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        block = json.loads(r.read())["autoscaling"]
    assert block["enabled"] is False and block["serving_workers"] == 2
    assert block["min_workers"] == block["max_workers"] == 2  # a fixed pool's bounds: its size


MIXED_ONLY = "autoscaling works on mixed workers only; "


@pytest.mark.parametrize("flags", [
    ["--prefill-workers", "1", "--decode-workers", "1", "--max-workers", "3"],
    ["--prefill-workers", "2", "--decode-workers", "1", "--min-workers", "0",
     "--max-workers", "2", "--upscale-delay-s", "5"],
    ["--prefill-workers", "1", "--decode-workers", "1", "--workers", "0", "--min-workers", "1"],
])
def test_autoscaling_with_worker_roles_is_refused_before_anything_starts(flags, capsys):
    with pytest.raises(ConfigError) as e:
        _cfg(*flags)
    assert str(e.value).startswith(MIXED_ONLY)
    assert "--prefill-workers" in str(e.value) and "--max-workers" in str(e.value)
    # the command: status 2 and that one line, before Ray or the model (neither is started)
    assert main(["serve", "--gpus-per-worker", "0", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and MIXED_ONLY in lines[0], lines


def test_autoscaling_with_worker_roles_is_refused_in_serve_config():
    for roles in ({"prefill_workers": 1, "decode_workers": 1},
                  {"prefill_workers": 1, "decode_workers": 2, "num_workers": 0}):
        with pytest.raises(ValidationError) as e:
            ServeConfig(**roles, autoscaling={"min_workers": 1, "max_workers": 3})
        assert [err["msg"].removeprefix("Value error, ") for err in e.value.errors()] == [
            e.value.errors()[0]["msg"].removeprefix("Value error, ")]
        assert MIXED_ONLY in str(e.value)
    # each alone is as before
    assert ServeConfig(prefill_workers=1, decode_workers=1).autoscaling is None
    assert ServeConfig(autoscaling={"max_workers": 3}).roles() == []
