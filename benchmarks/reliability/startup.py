"""Where `msaserve serve`'s startup goes: the same steps, timed one by one, in a fresh process.

    PYTHONPATH=. .venv/bin/python benchmarks/reliability/startup.py [--runs 2]

A child process (fresh interpreter, so imports count) runs what `msaserve serve` runs, in order,
and stamps each step: importing Ray / Serve / msaserve, `ray.init` (GCS, raylet, dashboard, on
loopback), `serve.start` (controller + HTTP proxy), `serve.run` (the deployments' replicas
constructed), `/ready` 200 (the model replica loaded its engine and answered a 1-token probe), and
the first 200 on /v1/chat/completions. The model replica's own log line ("engine for ... ready in
X s") splits the engine load from the replica start. Then the engine's load alone, in process:
weights (`load_model`) and the engine's start.

Prints a table last and writes `hardening.startup_phase_<step>_s` entries into
benchmarks/results/hardening.json (then `python benchmarks/merge_summary.py`).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hardening import RESULTS, conditions, entry  # noqa: E402

STEPS = ("python_start", "imports", "ray_init", "serve_start", "serve_run", "ready", "first_answer")


def child(port: int, dashboard: bool = True) -> None:
    """Run `msaserve serve`'s steps, printing `STEP <name> <unix time>` after each."""

    def stamp(name: str) -> None:
        print(f"STEP {name} {time.time():.4f}", flush=True)

    stamp("python_start")
    import httpx
    import ray
    from ray import serve

    from msaserve.platform.app import APP_NAME, build_app
    from msaserve.platform.cli.serve import wait_until_ready
    from msaserve.platform.config import ServeConfig
    from msaserve.platform.http_limits import apply_proxy_limits, proxy_http_options
    from msaserve.platform.ray_defaults import apply_local_loopback, apply_ray_defaults

    stamp("imports")
    config = ServeConfig.from_dict({"http": {"port": port}})
    apply_ray_defaults()
    apply_local_loopback()
    apply_proxy_limits(config.http)
    context = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=dashboard,
                       dashboard_host="127.0.0.1", dashboard_port=0, log_to_driver=False)  # fmt: skip
    stamp("ray_init")
    try:
        serve.start(http_options=proxy_http_options(config.http))
        stamp("serve_start")
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        stamp("serve_run")
        base = f"http://127.0.0.1:{port}"
        wait_until_ready(base)
        stamp("ready")
        body = {"model": config.model.resolved_name(), "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        stamp("first_answer")
        print(f"LOGS {context.address_info['session_dir']}/logs", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


def _engine_load_in_replica(logs: Path) -> float | None:
    for path in sorted(logs.glob("serve/replica_msaserve_Model_*.log")):
        found = re.findall(r"engine for \S+ ready in ([0-9.]+)s", path.read_text(errors="replace"))
        if found:
            return float(found[-1])
    return None


def one_run(port: int, dashboard: bool = True) -> dict[str, float]:
    """Seconds from the launch of the child to each step, and the replica's engine load."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launched = time.time()
    argv = [sys.executable, __file__, "--child", "--port", str(port)]
    argv += [] if dashboard else ["--no-dashboard"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    stamps = {m[0]: float(m[1]) for m in re.findall(r"^STEP (\w+) ([0-9.]+)$", out.stdout, re.M)}
    if "first_answer" not in stamps:
        raise RuntimeError(f"startup child failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    row = {name: stamps[name] - launched for name in STEPS}
    logs = re.search(r"^LOGS (.+)$", out.stdout, re.M)
    row["engine_load_in_replica"] = _engine_load_in_replica(Path(logs[1])) if logs else None
    return row


def engine_load_in_process() -> dict[str, float]:
    import asyncio

    from msaserve.engine.async_engine import AsyncEngine
    from msaserve.engine.llm_engine import LLMEngine, load_engine_model
    from msaserve.platform.config import ServeConfig
    from msaserve.platform.model_deployment import engine_config_from

    config = engine_config_from(ServeConfig.from_dict({}))
    start = time.perf_counter()
    model, tokenizer = load_engine_model(config)
    weights = time.perf_counter() - start
    engine = AsyncEngine(config, engine=LLMEngine(config, model, tokenizer))
    asyncio.run(engine.start())
    total = time.perf_counter() - start
    asyncio.run(engine.shutdown())
    return {"weights_in_process": weights, "engine_in_process": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=8433)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--no-dashboard", action="store_true",
                        help="ray.init without the dashboard, to see what it costs (prints only: "
                        "`msaserve serve` starts it)")
    args = parser.parse_args()
    if args.child:
        child(args.port, dashboard=not args.no_dashboard)
        return 0
    command = "PYTHONPATH=. .venv/bin/python benchmarks/reliability/startup.py " + " ".join(sys.argv[1:])
    under = conditions()
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.port, dashboard=not args.no_dashboard) | {"load_1m": os.getloadavg()[0]})
        print(f"run {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1].items() if v is not None),
              flush=True)
    best = min(runs, key=lambda r: r["first_answer"])
    best |= engine_load_in_process()
    print(f"\n{'step (best run)':<26} {'s from launch':>13} {'s in step':>10}")
    previous = 0.0
    for name in STEPS:
        print(f"{name:<26} {best[name]:>13.2f} {best[name] - previous:>10.2f}")
        previous = best[name]
    for name in ("engine_load_in_replica", "weights_in_process", "engine_in_process"):
        if best.get(name) is not None:
            print(f"{name:<26} {'':>13} {best[name]:>10.2f}")
    if args.no_write or args.no_dashboard:
        return 0
    note = (f"best of {args.runs} runs of `msaserve serve`'s steps in a fresh process (seconds from launch: "
            + ", ".join(f"{k} {best[k]:.1f}" for k in STEPS) + "); all runs: "
            + json.dumps([{k: round(v, 2) for k, v in r.items() if v is not None} for r in runs]))
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous = 0.0
    for name in STEPS:
        results[f"hardening.startup_phase_{name}_s"] = entry(best[name] - previous, "s", command, note, under)
        previous = best[name]
    for name in ("engine_load_in_replica", "weights_in_process", "engine_in_process"):
        if best.get(name) is not None:
            results[f"hardening.startup_{name}_s"] = entry(best[name], "s", command, note, under)
    RESULTS.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
