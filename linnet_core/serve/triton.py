"""`linnet export triton`: a Triton Inference Server model repository whose Python model drives the
same engine as `linnet serve` (decoupled, with the vLLM Triton backend's inputs and outputs)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from ..compile import Model, open_model, pick_cache_len, pick_dtype
from ..errors import InputError
from ..export import ExportResult, output_folder, summarize
from . import free_port
from .config import ServeConfig

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] }},
  {{ name: "finish_reason", data_type: TYPE_STRING, dims: [ -1 ] }}
]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters [
{parameters}
]
"""
PARAMETER = '  {{ key: {key}, value: {{ string_value: {value} }} }}'


def _quoted(text: str) -> str:
    """A protobuf text-format string: JSON's escapes for quotes, backslashes and control characters are
    text format's too; other characters as they are (UTF-8)."""
    return json.dumps(text, ensure_ascii=False)


def export_triton(model: str | Path | Model | None, out: Path, config: ServeConfig = ServeConfig(),
                  name: str | None = None, env: Path | None = None, force: bool = False) -> ExportResult:
    """Write OUT/<name>/config.pbtxt and OUT/<name>/1/model.py: the model and every engine setting of
    `config` as `linnet_*` parameters (edit them there; the model reads them at load). `env` is the
    Python environment Triton runs the model in (linnet installed, and numpy < 2 for the python
    backend's stub)."""
    started = time.perf_counter()
    m = model if isinstance(model, Model) else open_model(model)
    config = replace(config, model=str(m.path.resolve()), dtype=pick_dtype(config.dtype, m.spec),
                     cache_len=pick_cache_len(config.cache_len, m.spec))
    name = name or "".join(c if c.isalnum() or c in "-_" else "_" for c in m.path.name)
    if env is not None and not (Path(env) / "bin" / "python").exists() and not str(env).endswith(".tar.gz"):
        raise InputError(f"{env} is not a Python environment (no bin/python) nor a conda-pack archive")
    parameters = config.to_parameters()
    if env is not None:
        parameters["EXECUTION_ENV_PATH"] = str(Path(env).resolve())
    with output_folder(Path(out), force) as tmp:
        (tmp / name / "1").mkdir(parents=True)
        shutil.copy2(Path(__file__).with_name("triton_model.py"), tmp / name / "1" / "model.py")
        (tmp / name / "config.pbtxt").write_text(CONFIG.format(name=name, parameters=",\n".join(
            PARAMETER.format(key=_quoted(k), value=_quoted(v)) for k, v in parameters.items())), encoding="utf-8")
    return summarize(Path(out), started)


# -- a local Triton for tests and the serving bench --------------------------------------------
# The `nvidia-pytriton` wheel ships `tritonserver` with its Python backend; it runs on CPU. It pins
# numpy < 2, so it is installed apart (pip --target), and the model runs in an environment of its
# own (EXECUTION_ENV_PATH) with numpy < 2 first and this environment's packages after it.
PYTRITON = "nvidia-pytriton==0.7.0"


def prepare_local_triton(home: Path) -> tuple[Path, Path]:
    """(tritonserver's folder, the model's Python environment) under `home`, made once with pip."""
    import subprocess
    import sys
    import sysconfig

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    server = home / "site" / "pytriton" / "tritonserver"

    def run(*cmd: str) -> None:
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as e:
            raise InputError(f"cannot set up a local Triton in {home}: {' '.join(cmd[:6])}... failed ({e})") from None

    if not (server / "bin" / "tritonserver").exists():
        run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(home / "site"), PYTRITON)
    stub = server / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():  # the stub for this Python, beside the backend that starts it
        shutil.copy2(server / "python_backend_stubs" / py / "triton_python_backend_stub", stub)
    env = home / f"env-{py}"
    packages = env / "lib" / f"python{py}" / "site-packages"
    if not (env / "bin" / "python").exists():
        run(sys.executable, "-m", "venv", "--without-pip", str(env))
    if not (packages / "ml_dtypes").exists():  # xgrammar's ml_dtypes, of a release built for numpy 1
        run(sys.executable, "-m", "pip", "install", "--quiet", "--target", str(packages), "numpy<2", "ml_dtypes<0.5")
    base = sysconfig.get_paths()["purelib"]
    (packages / "zz_linnet_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    return server, env


def launch_local_triton(repo: Path, server: Path, port: int, log: Path, timeout: float = 300,
                        grpc_port: int | None = None):
    """Start tritonserver on `repo` (HTTP on `port`, gRPC on `grpc_port` or a free one); returns the
    process once the repository is ready."""
    import os
    import subprocess

    import httpx

    env = {**os.environ, "LD_LIBRARY_PATH": str(server.parent.parent / "nvidia_pytriton.libs")}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(server / "bin" / "tritonserver"), f"--model-repository={repo}",
                                 f"--backend-directory={server / 'backends'}", f"--http-port={port}",
                                 f"--grpc-port={grpc_port or free_port()}", f"--metrics-port={free_port()}", "--disable-auto-complete-config"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    proc.wait()
    raise InputError(f"tritonserver did not become ready; its log: {log}")
