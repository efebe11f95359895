"""`linnet serve --ray`: Linnet's engine as Ray Serve applications (`pip install 'linnet[ray]'`).

One Ray Serve application per model, each replica one engine running `linnet serve`'s own app
in-process (`asgi_call`), and one HTTP front (`ray_front`) in the process that deployed them: it
checks the API key, picks the model by the request's `model`, keys the request by its prompt's head
and forwards it through the model's deployment handle, whose router (`ray_router`) sends it to the
replica holding that prefix. Ray Serve does the rest: replicas placed by their CPUs and GPUs,
restarted when they die, autoscaled on requests in flight, drained on scale-down. Replicas report
their metrics to a small board actor the front's /metrics reads, each sample labelled with its model
and replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..artifact_store import STORE_ENV
from ..errors import BackendUnavailable, InputError
from .ray_board import NAMESPACE, board
from .ray_front import Front
from .ray_ingress import deployment_name
from .ray_replica import ModelReplica, ModelSpec
from .ray_router import PrefixAffinityRouter

# Replicas run their (async, non-blocking) code on Ray Serve's own loop: a thread hop less each way,
# as Ray's throughput-optimized mode sets it (bench/serving_ray.py).
FAST_PATH = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
GONE_TIMEOUT_S = 600.0  # deleting the applications: their replicas drain first (each its drain timeout)


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
                "logging_config": {"enable_access_log": False},  # as `linnet serve`: no file write per request
                "max_ongoing_requests": rows * 4,  # past this Ray's handle queues, where the autoscaler sees it
                "graceful_shutdown_timeout_s": self.drain_timeout, "request_router_config": routing, **count}


def applications(models: list[ModelSpec], scaling: Scaling, app_name: str = "linnet") -> list[serve.RunTarget]:
    """One Ray Serve application per model (no HTTP route: the front calls them), named
    `application_name(app_name, model)`."""
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise InputError(f"two models would be served as one name ({', '.join(names)}); give each its own")
    targets = []
    for spec in models:
        deployment = serve.deployment(ModelReplica, name=deployment_name(spec.name),
                                      **scaling.deployment_options(spec.config.rows))
        bound = deployment.bind(spec, scaling.threads, app_name, scaling.drain_timeout)
        targets.append(serve.RunTarget(bound, name=application_name(app_name, spec.name), route_prefix=None))
    return targets


def application_name(app_name: str, model: str) -> str:
    return f"{app_name}.{deployment_name(model)}"


def connect(address: str | None = None, **init) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS's), or start one on this machine (`init`: its
    resources, as `ray.init` takes them)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, **init)


@dataclass
class Deployed:
    """A Linnet application on Ray as this process serves it: its models' Ray Serve applications and
    the front serving them. `owned`: this process deployed them, and deletes them when it closes."""

    app_name: str
    applications: list[str]
    front: Front
    owned: bool = True

    @property
    def url(self) -> str:
        return self.front.url

    def close(self) -> None:
        """New requests get a 503; those in flight finish (on their replicas, each model's drain
        timeout at most); then the applications (when owned), the front and the board go."""
        self.front.refuse_new()
        if self.owned:
            remove(self.app_name, self.applications)
        self.front.stop()


def deploy(models: list[ModelSpec], scaling: Scaling, host: str, port: int, app_name: str = "linnet",
           api_key: str | None = None, address: str | None = None, max_connections: int = 1024,
           per_peer: int | None = None, ray_init: dict | None = None, join: bool = False) -> Deployed:
    """Take host:port, connect to (or start) a Ray cluster (`ray_init`: more `ray.init` arguments),
    deploy each model's application, wait until their replicas run, and start the front there.
    `join`: deploy nothing; serve another front for the applications another process deployed."""
    targets = applications(models, scaling, app_name)
    names = [t.name for t in targets]
    where = {m.name: (deployment_name(m.name), name) for m, name in zip(models, names, strict=True)}
    front = Front(where, app_name, host, port, api_key, max_connections=max_connections, per_peer=per_peer,
                  graceful_s=scaling.drain_timeout)
    front.bind()
    try:
        connect(address, **(ray_init or {}))
        running = set(serve.status().applications) & set(names)
        if join and running != set(names):
            missing = ", ".join(repr(n) for n in names if n not in running)
            raise InputError(f"nothing to join: {missing} does not run on this cluster; start it with "
                             "`linnet serve --ray` (without --join)")
        if not join and running:
            raise InputError(f"{', '.join(repr(n) for n in sorted(running))} already runs on this cluster (another "
                             "`linnet serve --ray`); add --join to serve another front for it")
    except BaseException:
        front.stop()
        raise
    if not join:
        _run(targets, front, app_name)
    try:
        front.start()
    except BaseException:
        if not join:
            remove(app_name, names)
        raise
    return Deployed(app_name, names, front, owned=not join)


def _run(targets: list, front: Front, app_name: str) -> None:
    board(app_name)
    serve.start(proxy_location="Disabled")  # no Ray HTTP proxy: the front is the application's HTTP face
    try:
        serve.run_many(targets)
    except BaseException as e:  # nothing half-deployed stays behind: not on a failure, nor on Ctrl-C
        front.stop()
        remove(app_name, [t.name for t in targets])
        if not isinstance(e, RuntimeError):
            raise
        # a replica could not start (Ray Serve gave up after its retries)
        reason = next((line.strip() for line in str(e).splitlines() if "Error" in line), str(e).splitlines()[0])
        raise BackendUnavailable(f"the application did not start on Ray: {reason}",
                                 hint="the replicas' logs are under the cluster's session folder "
                                      "(/tmp/ray/session_latest/logs/serve)") from None


def remove(app_name: str, applications: list[str]) -> None:
    """Delete the applications (their replicas drain first, all at once) and the board."""
    for name in applications:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while set(applications) & set(serve.status().applications) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        ray.kill(ray.get_actor(f"board-{app_name}", namespace=NAMESPACE))
    except ValueError:
        pass  # never created, or already gone
