"""`msaserve serve`: a local Ray on loopback, the default app (SmolLM2 on CPU), until Ctrl-C."""

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import httpx

from msaserve.engine.model_loading import ModelFileMissing, check_model_spec
from msaserve.platform.config import ConfigError, ServeConfig

DASHBOARD_PORT = 8265


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="Serve the OpenAI-compatible API on a local Ray cluster.")
    p.add_argument("--config", type=Path, help="ServeConfig YAML (default: SmolLM2 on CPU, 127.0.0.1:8000).")
    p.add_argument("--model", help="Override model.spec: smollm2, tiny, m3-proxy, m3-mini (GPU) or a "
                   "checkpoint path (a directory whose config.json model_type is registered, e.g. "
                   "minimax_m3_vl).")
    p.add_argument("--host", help="Override http.host (default 127.0.0.1).")
    p.add_argument("--port", type=int, help="Override http.port (default 8000).")
    p.add_argument("--dashboard-port", type=int, default=DASHBOARD_PORT, help="Ray dashboard port.")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus export port (0 = any free).")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule (default: all).")
    p.add_argument("--verbose", action="store_true", help="Stream Ray and replica logs to this terminal.")
    p.set_defaults(func=run)


def load_config(args: argparse.Namespace) -> ServeConfig:
    data = ServeConfig.from_yaml(args.config).model_dump() if args.config else {}
    if args.model:
        data.setdefault("model", {})["spec"] = args.model
    for name in ("host", "port"):
        if getattr(args, name) is not None:
            data.setdefault("http", {})[name] = getattr(args, name)
    return ServeConfig.from_dict(data)


RAY_FIXED_PORTS = frozenset({52365, 8265, 6379, 10001})
"""Ports Ray's components take by default when not given one (the dashboard agent's HTTP port, the
dashboard, the GCS, the client server): a port picked for the metrics exporter must not be one of
them, or `ray.init` refuses to start (a CI run drew 52365 from the OS, once)."""


def _free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A port free on 127.0.0.1 now, other than Ray's fixed defaults and `avoid`."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_FIXED_PORTS and port not in avoid:
            return port


def dashboard_auth_hint() -> str:
    """How to get past the dashboard's token auth (on by default since Ray 2.52)."""
    mode = os.environ.get("RAY_AUTH_MODE", "token").lower()
    if mode == "disabled":
        return "token auth is disabled (RAY_AUTH_MODE=disabled): anyone who can reach the port can use it"
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "the value of $RAY_AUTH_TOKEN"
        curl = 'curl -H "Authorization: Bearer $RAY_AUTH_TOKEN" ...'
    else:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
        source = f"the token in {path} (`ray get-auth-token` prints it)"
        curl = f'curl -H "Authorization: Bearer $(cat {path})" ...'
    return f"token auth is on: paste {source} when the dashboard asks; from scripts: {curl}"


def deployment_messages(status: Any, app_name: str) -> dict[str, str]:
    """Serve's own word on each deployment of `app_name` that is not yet running (e.g. replicas that
    cannot be scheduled, with the resources one needs and what the cluster has free), and the app's."""
    app = status.applications.get(app_name)
    if app is None:
        return {}
    messages = {name: d.message for name, d in app.deployments.items() if d.message}
    if app.message:
        messages[app_name] = app.message
    return messages


def deploy_with_progress(deploy: Callable[[], Any], status: Callable[[], Any], app_name: str,
                         poll_s: float = 2.0, out: TextIO = sys.stdout) -> None:
    """Run `deploy` (serve.run: it blocks until every replica is up, which never happens while one
    cannot be scheduled) in a thread, printing each new message Serve gives about the deployments
    meanwhile, so a cluster too small for the config says so instead of waiting in silence."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            deploy()
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="serve-deploy", daemon=True).start()
    shown: dict[str, str] = {}
    while not done.wait(poll_s):
        try:
            messages = deployment_messages(status(), app_name)
        except Exception:  # the controller may not answer yet: ask again
            continue
        for name, message in messages.items():
            if shown.get(name) != message:
                print(f"  {name}: {message}", file=out, flush=True)
                shown[name] = message
    if failure:
        raise failure[0]


class ModelLoadFailed(RuntimeError):
    """The model replica reported that the model failed to load (the readiness probe's 503)."""


def wait_until_ready(base_url: str, timeout_s: float = 600.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            response = httpx.get(base_url + "/ready", timeout=30)
            if response.status_code == 200:
                return time.monotonic() - start
            error = response.json().get("error", {})
            if error.get("code") == "model_failed":
                raise ModelLoadFailed(error.get("message"))
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/ready did not answer 200 within {timeout_s:.0f}s")


def banner(config: ServeConfig, base_url: str, dashboard_url: str, metrics_url: str) -> str:
    auth = (
        "API keys required: send 'Authorization: Bearer <key>'"
        if config.auth.resolve_keys()
        else "no API key needed (set auth.api_keys in --config to require one)"
    )
    return "\n".join([
        f"msaserve is serving {config.model.resolved_name()!r}",
        f"  API (OpenAI-compatible): {base_url}/v1      ({auth})",
        f"  API docs:                {base_url}/docs",
        f"  Ray dashboard:           {dashboard_url}",
        f"    {dashboard_auth_hint()}",
        f"  Prometheus metrics:      {metrics_url}",
        f"  Try: msaserve chat --url {base_url}/v1",
        "Press Ctrl-C to stop.",
    ])  # fmt: skip


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
        check_model_spec(config.model.spec)
    except ConfigError as e:
        print(f"msaserve serve: {e}", file=sys.stderr)
        return 2
    except ModelFileMissing as e:
        print(f"msaserve serve: model.spec: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from msaserve.platform.app import APP_NAME, build_app
    from msaserve.platform.http_limits import apply_proxy_limits, proxy_http_options
    from msaserve.platform.ray_defaults import apply_local_loopback, apply_ray_defaults

    metrics_port = args.metrics_port or _free_port(frozenset({config.http.port, args.dashboard_port}))
    apply_ray_defaults()  # before ray.init: the GCS reads them at start
    apply_local_loopback()  # every Ray port on 127.0.0.1, not only the API and the dashboard
    apply_proxy_limits(config.http)  # header/body deadlines and request caps inside Serve's proxy
    context = ray.init(
        address="local",
        _node_ip_address="127.0.0.1",  # Ray's own services on loopback too, not only HTTP
        num_cpus=args.num_cpus,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=args.dashboard_port,
        _metrics_export_port=metrics_port,
        log_to_driver=args.verbose,
    )
    # Ctrl-C and SIGTERM (e.g. from a process manager) both end in the clean shutdown below; SIGINT
    # is installed explicitly because shells start background jobs with it ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    status = 0
    try:
        host = config.http.host
        serve.start(http_options=proxy_http_options(config.http))
        print(f"Deploying the {APP_NAME!r} Serve app ...", flush=True)
        deploy_with_progress(lambda: serve.run(build_app(config), name=APP_NAME, route_prefix="/"),
                             serve.status, APP_NAME)
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        base_url = f"http://{shown_host}:{config.http.port}"
        dashboard = context.dashboard_url or f"127.0.0.1:{args.dashboard_port}"
        print(banner(config, base_url, f"http://{dashboard}", f"http://127.0.0.1:{metrics_port}/metrics"))
        print(
            f"Loading {config.model.resolved_name()} (the API answers 503 until it is ready) ...", flush=True
        )
        print(f"Ready in {wait_until_ready(base_url):.1f}s.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except ModelLoadFailed as e:
        print(f"msaserve serve: {e}", file=sys.stderr)
        status = 1
    finally:
        print("\nShutting down ...", flush=True)
        serve.shutdown()
        ray.shutdown()
    return status
