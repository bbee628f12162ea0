"""The Serve ingress deployment: gRPC methods (GrpcFrontend) and the OpenAI HTTP API in one.

Its constructor finds (or starts) the detached router actor, which starts the worker actors;
the ingress then only validates, asks the router for a worker and streams from that worker.
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve

from kvserve.deploy import admin, auth, grafana, limits, metrics
from kvserve.deploy import openai_api as oa
from kvserve.deploy.base_models import BaseModels
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.errors import ServiceError, for_model
from kvserve.deploy.grpc_api import GrpcFrontend
from kvserve.deploy.proxy_options import check_proxies
from kvserve.deploy.service import Service
from kvserve.deploy.shutdown import ShutdownWatch
from kvserve.router.lifecycle import ON_HEAD

app = FastAPI(title="kvserve", description="OpenAI-compatible API of kvserve")
app.add_middleware(limits.BodyLimit)


@app.exception_handler(RequestValidationError)
async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # OpenAI clients expect 400 (not FastAPI's 422) for a malformed body, bad JSON included
    metrics.rejected(ServiceError("invalid", ""))
    return oa.validation_error_response(exc)


@app.exception_handler(limits.BodyTooLarge)
async def _too_large(request: Request, exc: limits.BodyTooLarge) -> JSONResponse:
    return oa.error_response(limits.too_large(exc.limit))


@app.exception_handler(ServiceError)
async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    metrics.rejected(exc)
    return oa.error_response(exc)


@app.middleware("http")
async def _auth(request: Request, call_next: Any) -> Any:
    # checked before the body is parsed, so a bad key is a 401 whatever the body
    if request.url.path.startswith("/v1/"):
        err = auth.http_auth_error(request.headers)
        if err is not None:
            metrics.rejected(err)
            return oa.error_response(err)
    return await call_next(request)


# On the head, beside the router and Serve's controller (and the proxies, HeadOnly in the
# Helm chart): a worker node that is lost must not take the replica, and with it the streams
# it relays from the workers of every other node.
@serve.deployment(name="KVServeIngress",
                  ray_actor_options={"num_cpus": 0, "resources": ON_HEAD},
                  max_ongoing_requests=1000)
@serve.ingress(app)
class KVServeIngress(GrpcFrontend):
    async def __init__(self, config: dict[str, Any]) -> None:
        cfg = ServeConfig(**config)
        await check_proxies(cfg)  # ports the proxies do not use are refused, not ignored
        # one Service per base model (the first serves requests that name no model)
        self.models = BaseModels(cfg)
        self.service: Service = self.models.primary
        auth.set_keys(self.service.api_keys)
        metrics.start(self.service.model_name,
                      tuple(s.model_name for s in self.models.services[1:]))
        limits.set_max_request_bytes(self.service.cfg.max_request_bytes)
        await self.models.start()
        # Serve's graceful shutdown waits for requests in flight; this ends those still
        # running after shutdown_grace_s with UNAVAILABLE / 503 before Serve cuts them
        self.shutdown_watches = [ShutdownWatch(s, cfg.shutdown_grace_s)
                                 for s in self.models.services]
        for w in self.shutdown_watches:
            w.start()
        grafana.start_provisioning()  # kvserve's dashboard beside Ray's own (background)

    # ---- HTTP -----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            info = await self.models.server_info()
        except ServiceError as e:  # the router is restarting
            return JSONResponse({"status": "unavailable", "detail": e.message}, status_code=503)
        if len(info["models"]) > 1:  # every model needs a worker serving
            alive_of = {m["model"]: sum(w["alive"] for w in m["workers"]) for m in info["models"]}
            ok = all(alive_of.values())
            return JSONResponse({"status": "ok" if ok else "unavailable",
                                 "workers_alive": sum(alive_of.values()),
                                 "models": alive_of}, status_code=200 if ok else 503)
        alive = sum(w["alive"] for w in info["workers"])
        scaling = info.get("autoscaling") or {}
        if not alive and scaling.get("enabled") and scaling.get("min_workers") == 0:
            # scaled to zero by design: a request starts a worker and waits for it
            return JSONResponse({"status": "scaled_to_zero", "workers_alive": 0,
                                 "starting": scaling.get("starting_workers", 0)})
        return JSONResponse({"status": "ok" if alive else "unavailable", "workers_alive": alive},
                            status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        await self.models.refresh_models()
        return {"object": "list", "data": self.models.models()}

    @app.post("/v1/completions")
    async def completions(self, body: oa.CompletionRequest) -> Any:
        svc, lora = await self.models.pick(body.model)
        with for_model(svc.model_name):
            req = oa.completion_request(svc, body, lora)
            return await oa.respond(svc, req, body, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oa.ChatRequest) -> Any:
        svc, lora = await self.models.pick(body.model)
        with for_model(svc.model_name):
            req = oa.chat_request(svc, body, lora)
            return await oa.respond(svc, req, body, "chat")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: oa.LoadLoraRequest) -> PlainTextResponse:
        if body.load_inplace and body.lora_name in self.service.loras:
            await self.service.unload_lora(body.lora_name)
        await self.service.load_lora(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: oa.UnloadLoraRequest) -> PlainTextResponse:
        await self.service.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/admin/drain")
    async def drain(self, body: admin.DrainRequest) -> dict[str, Any]:
        return await admin.drain(self.models.base(body.model), body.worker, body.timeout_s)

    @app.post("/v1/admin/move")
    async def move(self, body: admin.MoveRequest) -> dict[str, Any]:
        return await admin.move(self.models.base(body.model), body.request_id, body.worker_id,
                                body.stop_and_copy)

    @app.get("/v1/server_info")
    async def server_info(self) -> dict[str, Any]:
        return await self.models.server_info()
