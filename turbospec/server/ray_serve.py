"""turbospec on Ray Serve: replicas of the OpenAI-compatible server behind one endpoint.

Two deployments make one Ray Serve application:
- ``TurboSpecReplica`` (``num_replicas`` of them, or autoscaled between ``min_replicas`` and ``max_replicas``):
  each owns an LLMEngine, its AsyncEngine and the same FastAPI app ``turbospec serve`` runs (``app.build_app``).
  A request reaches that app in-process (``ray_bridge.call_asgi``), so validation, errors, streaming and metrics
  are the single-server code. Each replica reports its outstanding tokens to the router
  (``record_routing_stats``) and fails its health check when its engine thread has died.
- ``OpenAIIngress`` (one replica, no CPU reserved): takes every HTTP request from Ray Serve's proxy and forwards
  it through a deployment handle (streamed, ``handle.options(stream=True)``); the handle's request router
  (``ray_router.TokenAwareRouter``) picks the replica. ``GET /metrics`` gathers every replica's metrics and adds
  a ``replica`` label. A replica that dies before the client saw a byte of its answer is replaced by the next
  one (``retries``); when none can take it, 503 with ``Retry-After`` and an OpenAI-style body; a stream cut
  mid-way ends with an error event (the 200 is already sent).

``serve run turbospec.server.ray_serve:build_app model=smollm2-135m num_replicas=2 routing=prefix`` runs it
(every ``key=value`` is a ``RayServeOptions`` field or an ``EngineConfig`` field); ``turbospec serve --ray``
does the same from the command line (``run``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..config import EngineConfig
from .errors import error_body, json_error
from .ray_bridge import FORWARDED_HEADERS, Forwarded, Message, call_asgi, merge_metrics, route_hint
from .ray_router import DEFAULT_IMBALANCE_TOKENS, ROUTING_MODES, RouteHint, replica_ids
from .responses import sse

log = logging.getLogger("ray.serve")  # Serve's logger: lines land in each replica's log file

APP_NAME = "turbospec"
ROUTER_CLASS = "turbospec.server.ray_router:TokenAwareRouter"
METRICS_TIMEOUT_S = 10.0
# a dead replica's actor, or no replica at all: another replica (or a later try) can serve the request
RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
             serve.exceptions.ReplicaUnavailableError, serve.exceptions.DeploymentUnavailableError,
             serve.exceptions.BackPressureError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)


@dataclass
class RayServeOptions:
    """How many replicas, how requests are routed to them, and each replica's engine (EngineConfig fields)."""

    model: str
    served_model_name: str | None = None
    num_replicas: int = 1
    min_replicas: int | None = None  # min/max: autoscale (Ray Serve's autoscaling_config) instead of num_replicas
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica; default max_num_seqs / 2
    routing: str = "fewest-tokens"
    imbalance_tokens: int = DEFAULT_IMBALANCE_TOKENS  # prefix routing gives up affinity beyond this imbalance
    max_pending_requests: int = 256  # per replica, as --max-pending-requests
    retries: int = 2  # other replicas tried when one dies before the client saw anything
    health_check_period_s: float = 2.0
    routing_stats_period_s: float = 0.5
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields except model

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"unknown routing {self.routing!r}: expected one of {', '.join(ROUTING_MODES)}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("min_replicas and max_replicas go together (autoscaling bounds)")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas >= 1:
            raise ValueError(f"autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        for name in ("num_replicas", "max_pending_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.engine.get("num_threads") is None:  # every replica (each rank of it) must fit: share the cores
            processes = (self.max_replicas or self.num_replicas) * self.engine.get("tensor_parallel_size", 1)
            self.engine["num_threads"] = max(1, (os.cpu_count() or 1) // processes)
        self.engine_config()  # refuse bad engine options here, not in every replica

    @classmethod
    def from_args(cls, args: dict[str, str]) -> RayServeOptions:
        """From ``serve run``'s ``key=value`` strings: this class's fields and EngineConfig's."""
        own = {f.name: f for f in fields(cls) if f.name != "engine"}
        engine_fields = {f.name: f for f in fields(EngineConfig) if f.name != "model"}
        kwargs: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for key, value in args.items():
            key = key.replace("-", "_")
            if key in own:
                kwargs[key] = _parse(value, str(own[key].type))
            elif key in engine_fields:
                engine[key] = _parse(value, str(engine_fields[key].type))
            else:
                raise ValueError(f"unknown option {key!r}: expected one of {', '.join(sorted([*own, *engine_fields]))}")
        if "model" not in kwargs:
            raise ValueError("model=... is required")
        return cls(**kwargs, engine=engine)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(self.model, **self.engine)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


def _parse(value: str, annotation: str) -> Any:
    if value.lower() in ("none", "null") and "None" in annotation:
        return None
    for kind, convert in (("bool", lambda v: v.lower() in ("1", "true", "yes")), ("int", int), ("float", float)):
        if kind in annotation:
            try:
                return convert(value)
            except ValueError:
                if "str" not in annotation and "dict" not in annotation:
                    raise ValueError(f"expected {annotation}, got {value!r}") from None
    return value


# --- the replica ---------------------------------------------------------------------------------------------

@serve.deployment(name="TurboSpecReplica")
class TurboSpecReplica:
    async def __init__(self, engine_options: dict[str, Any], model_name: str, max_pending: int) -> None:
        from ..tuning import build_engine
        from .app import build_app

        config = EngineConfig(**engine_options)
        engine = await asyncio.to_thread(build_engine, config, None, False)  # loading blocks: off the event loop
        self.app = build_app(engine, model_name, max_pending)
        self.async_engine = self.app.state.async_engine
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread on this replica's event loop
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s serving %r", self.replica_id, model_name)

    async def handle(self, req: Forwarded, hint: RouteHint | None = None) -> AsyncIterator[Message]:
        """Run one HTTP request through this replica's app (`hint` is the router's, unused here)."""
        async for message in call_asgi(self.app, req):
            yield message

    async def metrics(self, hint: RouteHint | None = None) -> tuple[str, str]:
        body = b"".join([m[1] async for m in call_asgi(self.app, Forwarded("GET", "/metrics")) if m[0] == "body"])
        return self.replica_id, body.decode()

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray Serve every routing_stats_period_s; handed to the routers as `routing_stats`."""
        return {"outstanding_tokens": self.async_engine.outstanding_tokens,
                "requests": self.async_engine.num_pending, "time": time.time()}

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose check fails: here, one whose engine thread has stopped."""
        if not self.async_engine.is_alive:
            raise RuntimeError(f"the engine is not running: {self.async_engine.error!r}")

    async def __del__(self) -> None:
        if hasattr(self, "_lifespan"):
            await self._lifespan.__aexit__(None, None, None)  # aborts what is left and stops the engine thread


# --- the ingress ---------------------------------------------------------------------------------------------

@serve.deployment(name="OpenAIIngress")
class OpenAIIngress:
    def __init__(self, replicas: DeploymentHandle, retries: int) -> None:
        self.replicas = replicas
        self.retries = retries
        self.app_name = serve.get_replica_context().app_name
        self.failovers = 0  # requests moved to another replica after theirs failed
        self.unavailable = 0  # requests that ended in a retryable error: a 503, or a stream cut by a dead replica

    async def __call__(self, request: Request) -> Response:
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # under a route_prefix other than "/": the app's own paths
            path = path[len(root):] or "/"
        if request.method == "GET" and path == "/metrics":
            return await self.metrics()
        req = Forwarded(request.method, path, request.url.query,
                        [(k, v) for k, v in request.headers.items() if k in FORWARDED_HEADERS], await request.body())
        return await self.forward(req, route_hint(req))

    async def forward(self, req: Forwarded, hint: RouteHint) -> Response:
        error: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.failovers += 1
                log.warning("replica failed (%r): trying another (%d of %d)", error, attempt, self.retries)
            stream = self.replicas.options(stream=True, method_name="handle").remote(req, hint=hint)
            try:
                start = await stream.__anext__()
                status, headers = start[1], [(k, v) for k, v in start[2] if k not in ("content-length",
                                                                                      "transfer-encoding")]
                if "text/event-stream" not in dict(headers).get("content-type", ""):
                    body = b"".join([m[1] async for m in stream])
                    return Response(body, status_code=status, headers=dict(headers))
                first = await anext(stream, None)  # a stream is moved only before its first byte
            except RETRYABLE as exc:
                stream.cancel()
                error = exc
                continue
            except asyncio.CancelledError:  # the client went away: the replica aborts the request
                stream.cancel()
                raise
            except Exception as exc:  # not the replica's death: a bug, answered as the single server would
                stream.cancel()
                log.exception("forwarding failed")
                return json_error(500, f"internal server error: {type(exc).__name__}: {exc}",
                                  "internal_server_error")
            return StreamingResponse(self._relay(stream, first), status_code=status, headers=dict(headers))
        self.unavailable += 1
        return json_error(503, f"no replica could serve the request after {self.retries + 1} tries ({error}): "
                               f"retry later", "server_error", code="replica_unavailable",
                          headers={"Retry-After": "1"})

    async def _relay(self, stream: Any, first: Message | None) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first[1]
            async for message in stream:
                yield message[1]
        except Exception as exc:  # the 200 is sent: the stream ends with an error event, as a single server's does
            self.unavailable += 1
            code = "replica_failed" if isinstance(exc, RETRYABLE) else "internal_error"
            yield sse(error_body(f"the replica serving this stream failed ({type(exc).__name__}: {exc}): retry "
                                 f"the request", "server_error", code=code)).encode()
            yield sse("[DONE]").encode()
        finally:
            stream.cancel()  # a client that left: the replica aborts the request

    async def metrics(self) -> Response:
        ids = replica_ids(self.app_name)
        if not ids:  # no request yet: the handle's router starts with the first call
            await self.replicas.options(method_name="metrics").remote()
            for _ in range(50):
                if ids := replica_ids(self.app_name):
                    break
                await asyncio.sleep(0.1)
        texts = {}
        for rid in ids:
            # one after another: calls made inside one request share its internal request id, and Ray Serve's
            # router matches a routed replica to its pending request by that id, so concurrent ones can stall
            call = self.replicas.options(method_name="metrics").remote(hint=RouteHint(target=rid))
            try:
                replica, text = await asyncio.wait_for(_await(call), METRICS_TIMEOUT_S)
            except Exception as exc:  # a replica that just died, or is not up yet: the scrape goes on
                call.cancel()
                log.warning("no metrics from replica %s: %r", rid, exc)
                continue
            texts[replica] = text
        own = ("# HELP turbospec:ray_replicas Replicas whose metrics this scrape holds\n"
               "# TYPE turbospec:ray_replicas gauge\n"
               f"turbospec:ray_replicas {len(texts)}\n"
               "# HELP turbospec:ray_failovers_total Requests moved to another replica after theirs failed\n"
               "# TYPE turbospec:ray_failovers_total counter\n"
               f"turbospec:ray_failovers_total {self.failovers}\n"
               "# HELP turbospec:ray_unavailable_total Requests failed with a retryable error: no replica could "
               "finish them\n"
               "# TYPE turbospec:ray_unavailable_total counter\n"
               f"turbospec:ray_unavailable_total {self.unavailable}\n")
        return Response(merge_metrics(texts) + own, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _await(response: Any) -> Any:
    return await response


# --- building and running ------------------------------------------------------------------------------------

def application(opts: RayServeOptions) -> serve.Application:
    """The ingress bound to the replica deployment, configured by `opts`."""
    engine = opts.engine_config()
    threads = engine.threads * engine.tensor_parallel_size  # the CPUs a replica's processes use
    seqs = engine.max_num_seqs
    if opts.min_replicas is not None:
        scaling: dict[str, Any] = {"autoscaling_config": {
            "min_replicas": opts.min_replicas, "max_replicas": opts.max_replicas,
            "initial_replicas": max(opts.min_replicas, 1),
            "target_ongoing_requests": opts.target_ongoing_requests or max(1.0, seqs / 2)}}
    else:
        scaling = {"num_replicas": opts.num_replicas}
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                 request_router_kwargs={"mode": opts.routing,
                                                        "imbalance_tokens": opts.imbalance_tokens},
                                 request_routing_stats_period_s=opts.routing_stats_period_s)
    replica = TurboSpecReplica.options(
        **scaling, max_ongoing_requests=opts.max_pending_requests + 8,  # the engine answers 503 past its limit
        ray_actor_options={"num_cpus": threads}, request_router_config=router,
        health_check_period_s=opts.health_check_period_s,
    ).bind({"model": opts.model, **opts.engine}, opts.name, opts.max_pending_requests)
    most = opts.max_replicas or opts.num_replicas
    ingress = OpenAIIngress.options(num_replicas=1, ray_actor_options={"num_cpus": 0},
                                    max_ongoing_requests=most * (opts.max_pending_requests + 8))
    return ingress.bind(replica, opts.retries)


def build_app(args: dict[str, str]) -> serve.Application:
    """The application builder for ``serve run turbospec.server.ray_serve:build_app model=NAME key=value ...``:
    keys are RayServeOptions fields (num_replicas, min_replicas, max_replicas, routing, ...) and EngineConfig
    fields (dtype, num_threads, max_model_len, speculative_config, ...)."""
    return application(RayServeOptions.from_args(args))


def run(opts: RayServeOptions, host: str, port: int, address: str | None = None) -> None:
    """Start a local Ray cluster (or join `address`), serve `opts` at host:port until SIGINT / SIGTERM, then
    remove the application (and, for a local cluster, Serve and Ray with it)."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    ray.init(address=address or "local", runtime_env=_runtime_env())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(opts), name=APP_NAME, route_prefix="/")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()


def _runtime_env() -> dict[str, Any]:
    """Workers import this checkout of turbospec, also where it is not installed (PYTHONPATH)."""
    import turbospec

    root = os.path.dirname(os.path.dirname(os.path.abspath(turbospec.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}

