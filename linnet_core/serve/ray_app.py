"""`linnet serve --ray`: Linnet's engine as a Ray Serve application (`pip install 'linnet[ray]'`).

One deployment per model, each replica one engine running `linnet serve`'s own app in-process
(`asgi_call`), behind one ingress deployment that checks the API key, picks the model by the
request's `model`, keys the request by its prompt's head and forwards it through the model's
deployment handle, whose router (`ray_router`) sends it to the replica holding that prefix. Ray Serve
does the rest: replicas placed by their CPUs and GPUs, restarted when they die, autoscaled on
requests in flight, drained on scale-down. Replicas report their metrics to a small board actor the
ingress's /metrics reads, each sample labelled with its model and replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..artifact_store import STORE_ENV
from ..errors import BackendUnavailable, InputError
from .ray_board import NAMESPACE, board
from .ray_ingress import Ingress, deployment_name
from .ray_replica import ModelReplica, ModelSpec
from .ray_router import PrefixAffinityRouter


# Replicas and the ingress run their (async, non-blocking) code on Ray Serve's own loop and route on
# the caller's loop: a thread hop less each way, as Ray's throughput-optimized mode sets them. The
# ingress's added latency at idle went from 6.0-6.5 to 5.0-5.2 ms median (bench/serving_ray.py).
FAST_PATH = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


@dataclass(frozen=True)
class Scaling:
    """How many replicas each model gets and what each one holds."""

    replicas: int = 1
    min_replicas: int | None = None  # with max_replicas: Ray Serve autoscales between the two
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    artifact_store: str | None = None  # LINNET_ARTIFACT_STORE in every replica
    drain_timeout: float = 30.0
    affinity: bool = True  # False: Ray Serve's own router (power of two choices on queue lengths), no prefix

    def __post_init__(self):
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise InputError("--min-replicas and --max-replicas go together (autoscaling between them)")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise InputError(f"--min-replicas ({self.min_replicas}) must be from 0 to --max-replicas "
                             f"({self.max_replicas})")
        if self.replica_cpus <= 0 or self.replica_gpus < 0:
            raise InputError("--replica-cpus must be above 0 and --replica-gpus at least 0")

    @property
    def threads(self) -> int:
        return max(1, int(self.replica_cpus))

    def deployment_options(self, rows: int) -> dict:
        env = {"OMP_NUM_THREADS": str(self.threads), **FAST_PATH}
        if self.artifact_store:
            env[STORE_ENV] = self.artifact_store
        if self.min_replicas is None:
            count = {"num_replicas": self.replicas}
        else:  # a replica's rows are its batch: more requests than that wait, so scale there
            count = {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                            "target_ongoing_requests": rows, "downscale_delay_s": 60}}
        # by the prompt's head; else Ray Serve's own router (power of two choices on queue lengths)
        prefix = {"request_router_class": PrefixAffinityRouter, "request_router_kwargs": {"busy_at": rows}}
        routing = RequestRouterConfig(**prefix) if self.affinity else RequestRouterConfig()
        return {"ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus,
                                      "runtime_env": {"env_vars": env}},
                "max_ongoing_requests": rows * 4,  # past this Ray's handle queues, where the autoscaler sees it
                "graceful_shutdown_timeout_s": self.drain_timeout, "request_router_config": routing, **count}


def application(models: list[ModelSpec], scaling: Scaling, app_name: str = "linnet", api_key: str | None = None,
                max_body_bytes: int = 1 << 20):
    """The bound Ray Serve application: one deployment per model, one ingress."""
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise InputError(f"two models would be served as one name ({', '.join(names)}); give each its own")
    bound = {}
    for spec in models:
        deployment = serve.deployment(ModelReplica, name=deployment_name(spec.name),
                                      **scaling.deployment_options(spec.config.rows))
        bound[spec.name] = deployment.bind(spec, scaling.threads, app_name, scaling.drain_timeout)
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": FAST_PATH}})
    return ingress.bind(bound, app_name, api_key, max_body_bytes)


def connect(address: str | None = None, **init) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS's), or start one on this machine (`init`: its
    resources, as `ray.init` takes them)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, **init)


def deploy(models: list[ModelSpec], scaling: Scaling, host: str, port: int, app_name: str = "linnet",
           api_key: str | None = None, address: str | None = None) -> str:
    """Connect to (or start) a Ray cluster, deploy the application and wait until it answers; its URL."""
    app = application(models, scaling, app_name, api_key)
    connect(address)
    board(app_name)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(app, name=app_name, route_prefix="/", blocking=False)
    except RuntimeError as e:  # a replica could not start (Ray Serve gave up after its retries)
        undeploy(app_name)
        reason = next((line.strip() for line in str(e).splitlines() if "Error" in line), str(e).splitlines()[0])
        raise BackendUnavailable(f"the application did not start on Ray: {reason}",
                                 hint="the replicas' logs are under the cluster's session folder "
                                      "(/tmp/ray/session_latest/logs/serve)") from None
    return f"http://{host}:{port}/v1"


def undeploy(app_name: str = "linnet") -> None:
    """Delete the application (its replicas drain first) and its board."""
    serve.delete(app_name)
    try:
        ray.kill(ray.get_actor(f"board-{app_name}", namespace=NAMESPACE))
    except ValueError:
        pass  # never created, or already gone
