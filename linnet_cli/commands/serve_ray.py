"""`linnet serve --ray`: the same options as `linnet serve`, plus where the replicas go and how many.

An option of `serve`, not a command of its own: every engine option (backend, dtype, rows,
speculation...) and every HTTP one (host, port, API key, limits) means the same on one machine and on
a cluster, so they are declared once and a deployment is a flag away. The address is an option of
its own: an option with an optional value would swallow whatever follows it (MODEL, or the next
option) as the address."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Annotated, Optional

import typer

from linnet_core.errors import BackendUnavailable, InputError
from linnet_core.serve.config import ServeConfig, served_name

from ..output import Sink

# auto (a cluster this machine belongs to), HOST:PORT (its GCS) or ray://HOST:PORT (Ray Client)
_ADDRESS = re.compile(r"^(auto|ray://[^\s/]+|[\w.-]+:\d+)$")

RayOpt = Annotated[bool, typer.Option(
    "--ray", help="Serve on a Ray cluster with Ray Serve (`pip install 'linnet[ray]'`): the one at "
                  "--ray-address, else the one RAY_ADDRESS names, else a local one started for this command.")]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    "--ray-address", metavar="ADDRESS", help="With --ray: the cluster's address (auto, HOST:PORT, "
                                             "ray://HOST:PORT).")]
ReplicasOpt = Annotated[int, typer.Option("--replicas", min=1, help="With --ray: replicas of each model.")]
MinReplicasOpt = Annotated[Optional[int], typer.Option(
    "--min-replicas", min=0, help="With --ray and --max-replicas: autoscale each model between these, on "
                                  "requests in flight per replica (its --rows).")]
MaxReplicasOpt = Annotated[Optional[int], typer.Option("--max-replicas", min=1, help="See --min-replicas.")]
ReplicaCpusOpt = Annotated[float, typer.Option(
    "--replica-cpus", help="With --ray: CPUs each replica holds (its threads: the integer part).")]
ReplicaGpusOpt = Annotated[float, typer.Option("--replica-gpus", help="With --ray: GPUs each replica holds.")]
ExtraModelOpt = Annotated[Optional[list[str]], typer.Option(
    "--model", help="With --ray: one more model in the same application (repeat it), routed by the "
                    "request's `model`.")]
AffinityOpt = Annotated[bool, typer.Option(
    "--affinity/--no-affinity", help="With --ray: send requests whose prompts begin alike to the replica that "
                                     "has that beginning cached (else Ray Serve's router: the shorter of two queues).")]
JoinOpt = Annotated[bool, typer.Option(
    "--join", help="With --ray: deploy nothing; serve one more front for the models a `linnet serve --ray` runs on "
                   "the cluster (the same MODEL and --model), e.g. one per node behind a load balancer. On exit it "
                   "stops only its front.")]
ArtifactStoreOpt = Annotated[Optional[str], typer.Option(
    "--artifact-store", envvar="LINNET_ARTIFACT_STORE", show_envvar=True,
    help="Where replicas find compiled artifacts before compiling (a folder every node sees, or an fsspec "
         "URL such as s3://bucket/linnet); what one compiles, the others fetch.")]


@dataclass(frozen=True)
class RayRequest:
    """What `linnet serve` was asked, for the Ray face."""

    address: str | None
    extra_models: list[str]
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    artifact_store: str | None = None
    affinity: bool = True
    join: bool = False

    def check(self) -> None:
        if self.join:  # the replicas are as the deploying command made them
            given = [name for name, value, default in (
                ("--replicas", self.replicas, 1), ("--min-replicas", self.min_replicas, None),
                ("--max-replicas", self.max_replicas, None), ("--replica-cpus", self.replica_cpus, 1.0),
                ("--replica-gpus", self.replica_gpus, 0.0), ("--no-affinity", self.affinity, True)) if value != default]
            if given:
                raise InputError(f"{', '.join(given)}: set by the command that deployed the replicas; --join deploys "
                                 "nothing")
        if self.address is not None and not _ADDRESS.match(self.address):
            raise InputError(f"--ray-address is auto, HOST:PORT or ray://HOST:PORT, not {self.address!r}")


def refuse_cluster_options(address, extra_models, replicas, min_replicas, max_replicas, replica_cpus, replica_gpus,
                           affinity, join) -> None:
    """The cluster's options without --ray: one line, not a silent single process."""
    options = (("--ray-address", address, None), ("--model", extra_models, None), ("--replicas", replicas, 1),
               ("--min-replicas", min_replicas, None), ("--max-replicas", max_replicas, None),
               ("--replica-cpus", replica_cpus, 1.0), ("--replica-gpus", replica_gpus, 0.0),
               ("--no-affinity", affinity, True), ("--join", join, False))
    given = [name for name, value, default in options if value != default]
    if given:
        raise InputError(f"{', '.join(given)}: for a deployment on Ray; add --ray")


def serve_on_ray(request: RayRequest, model: str | None, config: ServeConfig, name: str | None, host: str,
                 port: int, api_key: str | None, max_tokens: int | None, drain_timeout: float,
                 max_connections: int | None, max_client_connections: int | None, sink: Sink) -> None:
    """Deploy (or, with --join, find what another command deployed), say where, and serve until Ctrl-C or
    SIGTERM; then turn new requests away, let those in flight finish, and delete what this command
    deployed."""
    request.check()
    try:
        with warnings.catch_warnings():  # Ray's own modules trip pydantic's deprecations: not the user's to act on
            warnings.simplefilter("ignore", DeprecationWarning)
            from linnet_core.serve import ray_app  # imports Ray, and only with --ray
    except ImportError as e:
        raise BackendUnavailable(f"linnet serve --ray needs {e.name}, which is not installed",
                                 hint="pip install 'linnet[ray]'") from None
    if name and request.extra_models:
        raise InputError("--name names the one model; with --model each is served by its own name")
    from linnet_core.compile import open_model  # imports torch, as Ray's application does

    for m in [model, *request.extra_models]:  # a bad model is one line here, not a replica failing on the cluster
        open_model(m)
    models = [ray_app.ModelSpec(name or served_name(model), config, max_tokens)]
    models += [ray_app.ModelSpec(served_name(m), replace(config, model=m), max_tokens) for m in request.extra_models]
    scaling = ray_app.Scaling(request.replicas, request.min_replicas, request.max_replicas, request.replica_cpus,
                              request.replica_gpus, request.artifact_store, drain_timeout, request.affinity)
    where = request.address or os.environ.get("RAY_ADDRESS") or "a cluster started on this machine"
    if request.join:
        sink.info(f"joining {', '.join(repr(m.name) for m in models)} on Ray ({where})")
    else:
        sink.info(f"deploying {', '.join(repr(m.name) for m in models)} on Ray ({where}); replicas compile or load "
                  "their models first")
    # as `linnet serve` counts them, for every replica the front may reach
    engines = len(models) * (request.max_replicas or request.replicas)
    total = max_connections or engines * (config.rows + config.max_waiting) + 64
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this command says what it did, in its own words
    deployed = ray_app.deploy(models, scaling, host, port, api_key=api_key, address=request.address,
                              max_connections=total, per_peer=max_client_connections,
                              ray_init={"logging_level": logging.WARNING}, join=request.join)
    each = (f"{request.min_replicas}-{request.max_replicas} replicas" if request.min_replicas is not None
            else f"{request.replicas} replica{'s' * (request.replicas > 1)}")
    routing = "by prompt prefix" if request.affinity else "by queue length"
    if request.join:
        sink.info(f"serving on {deployed.url}, one more front for the replicas on Ray Serve"
                  f"{'; API key required' if api_key else ''}")
    else:
        sink.info(f"serving on {deployed.url}, replicas on Ray Serve ({each} of each model, each holding "
                  f"{request.replica_cpus:g} CPU and {request.replica_gpus:g} GPU; routed {routing})"
                  f"{'; API key required' if api_key else ''}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    sink.info("stopping: requests in flight finish first")
    deployed.close()
