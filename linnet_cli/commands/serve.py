"""linnet serve: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from linnet_core.artifact_store import STORE_ENV
from linnet_core.errors import BackendUnavailable
from linnet_core.serve.config import ServeConfig, served_name
from linnet_core.serve.guard import ConnectionLimits, uvicorn_options

from ..options import (
    AdaptiveDraftOpt,
    BackendName,
    BackendOpt,
    BurstWaitOpt,
    CacheLenOpt,
    DecodeStallOpt,
    DraftBackendOpt,
    DraftDtypeOpt,
    DraftOpt,
    DraftTokensOpt,
    DtypeOpt,
    MaxWaitingOpt,
    OptionalModelArg,
    PrefillChunkOpt,
    PrefixCachingOpt,
    QuietOpt,
    RowsOpt,
    SpeculateOpt,
)
from ..output import Sink, handle_errors
from .serve_ray import (
    AffinityOpt,
    ArtifactStoreOpt,
    ExtraModelOpt,
    JoinOpt,
    MaxReplicasOpt,
    MinReplicasOpt,
    RayAddressOpt,
    RayOpt,
    RayRequest,
    ReplicaCpusOpt,
    ReplicaGpusOpt,
    ReplicasOpt,
    refuse_cluster_options,
    serve_on_ray,
)


@handle_errors
def serve_command(
    model: OptionalModelArg = None,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = ServeConfig.dtype,
    rows: RowsOpt = ServeConfig.rows,
    cache_len: CacheLenOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind (0.0.0.0 to serve beyond this machine).")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="LINNET_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every route but /health. Prefer the LINNET_API_KEY "
             "environment variable: a key on the command line shows in `ps` to every user of the machine.")] = None,
    max_waiting: MaxWaitingOpt = ServeConfig.max_waiting,
    max_connections: Annotated[Optional[int], typer.Option(
        "--max-connections", min=1, help="Open connections before uvicorn answers 503 (default: rows + "
        "--max-waiting + 64, room for /health and /metrics).")] = None,
    max_client_connections: Annotated[Optional[int], typer.Option(
        "--max-client-connections", min=1, help="Open connections one client address may hold (default: half of "
        "--max-connections), so no one client can take every slot.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1,
                                                      help="Largest max_tokens a request may ask for.")] = None,
    prefill_chunk: PrefillChunkOpt = ServeConfig.prefill_chunk,
    decode_stall: DecodeStallOpt = ServeConfig.decode_stall,
    burst_wait: BurstWaitOpt = ServeConfig.burst_wait_ms,
    prefix_caching: PrefixCachingOpt = ServeConfig.prefix_caching,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    draft_tokens: DraftTokensOpt = ServeConfig.draft_tokens,
    adaptive_draft: AdaptiveDraftOpt = ServeConfig.adaptive_draft,
    draft_backend: DraftBackendOpt = None,
    draft_dtype: DraftDtypeOpt = ServeConfig.draft_dtype,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="On SIGTERM, seconds to let requests "
                                                 "in flight finish.")] = 30.0,
    name: Annotated[Optional[str], typer.Option("--name", help="Model name the API reports and expects.")] = None,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    extra_models: ExtraModelOpt = None,
    replicas: ReplicasOpt = 1,
    min_replicas: MinReplicasOpt = None,
    max_replicas: MaxReplicasOpt = None,
    replica_cpus: ReplicaCpusOpt = 1.0,
    replica_gpus: ReplicaGpusOpt = 0.0,
    artifact_store: ArtifactStoreOpt = None,
    affinity: AffinityOpt = True,
    join: JoinOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Serve MODEL with continuous batching: POST /v1/completions and /v1/chat/completions (streamed
    with "stream": true), GET /v1/models, /health and /metrics (Prometheus). With --ray, on a Ray
    cluster: replicas of each model behind one API, each request sent to the replica that holds its
    prompt's prefix."""
    config = ServeConfig(model, backend.value, dtype, rows, cache_len, prefill_chunk, max_waiting, decode_stall,
                         burst_wait, prefix_caching, speculate, draft, draft_tokens, adaptive_draft,
                         draft_backend.value if draft_backend else None, draft_dtype)
    if ray:
        request = RayRequest(ray_address, extra_models or [], replicas, min_replicas, max_replicas, replica_cpus,
                             replica_gpus, artifact_store, affinity, join)
        return serve_on_ray(request, model, config, name, host, port, api_key, max_tokens, drain_timeout,
                            max_connections, max_client_connections, Sink(False, quiet))
    refuse_cluster_options(ray_address, extra_models, replicas, min_replicas, max_replicas, replica_cpus, replica_gpus,
                           affinity, join)
    if artifact_store:  # the cache reads it from the environment, as every command's does
        os.environ[STORE_ENV] = artifact_store
    try:
        import httptools  # noqa: F401 - the parser the connection guard runs on
        import uvicorn

        from linnet_core.serve.http import Limits, Server, create_app  # imports torch: not at start-up
    except ImportError as e:
        raise BackendUnavailable(f"linnet serve needs {e.name}, which is not installed",
                                 hint="pip install 'linnet[serve]'") from None
    from linnet_core.serve.fields import prompt_char_limit  # imports torch: not at start-up
    from linnet_core.serve.launch import launch  # imports torch: not at start-up

    sink = Sink(False, quiet)
    served = launch(config, progress=sink.info)
    session, compiled = served.session, served.compiled
    served_as = name or served_name(model)
    limits = Limits(max_tokens=min(max_tokens or session.cache_len, session.cache_len),
                    max_prompt_chars=prompt_char_limit(session.cache_len))
    app = create_app(Server(served.engine, served.tokenizer, served_as, limits), api_key, drain_timeout)
    sink.info(f"serving '{served_as}' on http://{host}:{port}/v1 ({compiled.backend}, {compiled.dtype}, {rows} rows "
              f"of {session.cache_len} positions){'; API key required' if api_key else ''}")
    total = max_connections or rows + max_waiting + 64
    guard = ConnectionLimits(per_peer=max_client_connections or max(1, total // 2))
    uvicorn.run(app, host=host, port=port, log_level="warning" if not quiet else "error",
                timeout_graceful_shutdown=int(drain_timeout) + 1, access_log=False,
                **uvicorn_options(guard, limits.max_body_bytes, total))
    os._exit(0)  # the engine thread and backend runtimes are done: skip slow interpreter teardown
