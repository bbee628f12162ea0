"""BaseModels alone: which base model's Service a request's `model` picks (the Services
real, their routers a stand-in answering `list_loras`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.deploy.base_models import BaseModels
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.errors import ServiceError
from kvserve.deploy.service import Service


class _Router:
    """Answers list_loras like the router: the adapters loaded now."""

    def __init__(self, loras: list[str]) -> None:
        self.loaded = loras

        async def listing() -> list[dict[str, Any]]:
            return [{"name": n, "source": f"/adapters/{n}", "root": 7} for n in self.loaded]

        self.list_loras = type("M", (), {"remote": staticmethod(listing)})


def _service(cfg: ServeConfig, loras: list[str]) -> Service:
    svc = Service.__new__(Service)  # no tokenizer, no router: only the naming is used here
    svc.cfg, svc.model_name, svc.router = cfg, cfg.model_name(), _Router(loras)
    svc.loras, svc.max_model_len, svc.other_models = {}, 512, frozenset()
    return svc


@pytest.fixture
def models() -> BaseModels:
    cfg = ServeConfig(model=["org/a", {"model": "org/b", "served_model_name": "b"}],
                      loras={"sql": "/adapters/sql"})
    first, second = cfg.per_model()
    return BaseModels(cfg, [_service(first, ["sql"]), _service(second, [])])


def test_model_names_pick_their_base_model(models):
    a, b = models.services

    def pick(name: str | None) -> tuple[Service, str | None]:
        return asyncio.run(models.pick(name))

    assert pick(None) == (a, None) and pick("") == (a, None) and pick("default") == (a, None)
    assert pick("org/a") == (a, None) and pick("b") == (b, None)
    # the adapters are the first model's: by name, or as base:adapter
    assert pick("sql") == (a, "sql") and pick("org/a:sql") == (a, "sql")
    # one loaded since (through another replica) is found on asking the router again
    a.router.loaded.append("chat")
    assert pick("chat") == (a, "chat")
    for name in ("b:sql", "nope", "b:"):
        with pytest.raises(ServiceError) as err:
            pick(name)
        assert err.value.kind == "not_found"
        assert all(repr(n) in err.value.message for n in ("org/a", "b", "sql", "chat"))


def test_listing_shows_every_model_with_its_adapters(models):
    asyncio.run(models.refresh_models())
    assert [(m["id"], m["parent"]) for m in models.models()] == [
        ("org/a", None), ("sql", "org/a"), ("b", None)]


def test_an_adapter_cannot_take_another_base_models_name(models):
    a, _ = models.services
    for name in ("b", "org/a", "default", "x:y"):
        with pytest.raises(ServiceError) as err:
            asyncio.run(a.load_lora(name, "/adapters/x"))
        assert err.value.kind == "invalid" and "other than the base models'" in err.value.message


def test_operators_calls_name_a_base_model(models):
    a, b = models.services
    assert models.base(None) is a and models.base("") is a and models.base("default") is a
    assert models.base("org/a") is a and models.base("b") is b
    for name in ("sql", "nope", "org/a:sql"):  # adapters run on their base model's workers
        with pytest.raises(ServiceError) as err:
            models.base(name)
        assert err.value.kind == "not_found"
        assert "'org/a', 'b'" in err.value.message
