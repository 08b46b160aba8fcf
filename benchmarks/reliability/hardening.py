"""Issue 26's figures, written to benchmarks/results/hardening.json (then merge_summary.py):

  fuzz        in-process property-based fuzz of every route  → hardening.fuzz_cases, hardening.fuzz_5xx
  tenants     cross-tenant probes (read, delete, list, prefix-cache hit) → hardening.cross_tenant_leaks
  slowloris   raw-socket slowloris on a live local app        → hardening.slowloris_held_s
  startup     `msaserve serve` (default SmolLM2 app) to the first answer → hardening.startup_s
              (its steps: startup.py)

8 concurrent streams, engine alone against HTTP in one run (hardening.cpu_8stream_tok_s and the
engine's figure): benchmarks/reliability/streams.py.

    PYTHONPATH=. .venv/bin/python benchmarks/reliability/hardening.py [--part fuzz,tenants,...]

The machine is shared: every entry records the 1-minute load average and the CPU count at the
time, and a torch GEMM rate measured just before (GFLOP/s), so that figures from different loads
can be compared.
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
sys.path.insert(0, str(ROOT / "tests"))

RESULTS = ROOT / "benchmarks" / "results" / "hardening.json"
KEY_A, KEY_B = "bench-key-a", "bench-key-b"


def gemm_gflops(seconds: float = 2.0) -> float:
    """fp32 512x512 matmuls on all cores for `seconds`: how much CPU this process gets right now."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return n * 2 * 512**3 / (time.perf_counter() - start) / 1e9


def conditions() -> dict:
    return {"load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
            "gemm_gflops": round(gemm_gflops(), 1)}


def entry(value: float, unit: str, command: str, note: str, measured_under: dict) -> dict:
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip()
    return {
        "value": round(value, 3), "unit": unit, "command": command,
        "hardware": f"CPU only: {platform.machine()}, {os.cpu_count()} cores shared with other work",
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "git_revision": revision,
        "note": note, "measured_under": measured_under,
    }  # fmt: skip


def part_fuzz(command: str, examples: int) -> dict:
    from inprocess_app import inprocess_gateway
    from inprocess_fuzzing import FUZZ_CONFIG, run_fuzz

    under = conditions()
    with inprocess_gateway(FUZZ_CONFIG) as gateway:
        report, elapsed = run_fuzz(gateway, examples, rng_seed=20261203)
    print(f"fuzz: {report.summary()} in {elapsed:.0f}s")
    for line in report.server_errors[:10]:
        print("  5xx:", line)
    note = (f"in process (gateway app + tiny engine), schemathesis {examples}/operation/mode + hostile JSON "
            f"{examples * 3}/route; statuses {dict(sorted(report.statuses.items()))}; by design "
            f"{dict(report.by_design)}; {elapsed:.0f} s")
    return {
        "hardening.fuzz_cases": entry(report.num_cases, "requests", command, note, under),
        "hardening.fuzz_5xx": entry(len(report.server_errors), "responses", command, note, under),
    }


PROBES = ("read", "delete", "list", "prefix_hit", "owner_lost_it")


def _tenant_probes(auth_config: dict, trials: int) -> tuple[dict[str, int], int]:
    """({probe: cross-tenant successes}, attempts) for `trials` sessions of key A probed by key B."""
    from inprocess_app import TINY_CONFIG, inprocess_gateway

    prompt = "a shared prefix long enough to fill several pages of the tiny model. " * 4
    found = dict.fromkeys(PROBES, 0)

    def auth(key: str, session: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key}"} | ({"X-Session-Id": session} if session else {})

    def chat(gateway, key: str, content: str, session: str | None = None) -> dict:
        body = {"model": "msaserve/tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        return gateway.request("POST", "/v1/chat/completions", json=body, headers=auth(key, session)).json()

    with inprocess_gateway({**TINY_CONFIG, "auth": auth_config}) as g:
        for i in range(trials):
            session = f"s-{i}"
            unique = f"trial {i}: " + prompt  # a prefix only this trial's A request sent before B's
            chat(g, KEY_A, unique + "a", session)
            listed = g.request("GET", "/v1/sessions", headers=auth(KEY_B)).json()["data"]
            def status(method: str, key: str, session: str = session) -> int:
                return g.request(method, f"/v1/sessions/{session}", headers=auth(key)).status_code

            outcome = {
                "read": status("GET", KEY_B) != 404,
                "delete": status("DELETE", KEY_B) != 404,
                "list": session in {s["id"] for s in listed},
                "prefix_hit": chat(g, KEY_B, unique + "b")["usage"]["prompt_tokens_details"]["cached_tokens"]
                > 0,
                "owner_lost_it": status("GET", KEY_A) != 200,
            }
            for probe, leaked in outcome.items():
                found[probe] += leaked
    return found, trials * len(PROBES)


def part_tenants(command: str, trials: int) -> dict:
    under = conditions()
    leaks, attempts = _tenant_probes({"api_keys": [KEY_A, KEY_B]}, trials)
    # Control: the same probes with the operator's opt-in to a shared prefix cache must see the hit
    # (so the probe can detect a leak), and nothing else.
    control, _ = _tenant_probes({"api_keys": [KEY_A, KEY_B], "share_prefix_cache": True}, trials)
    print(f"tenants: {sum(leaks.values())} leaks in {attempts} cross-tenant probes {leaks}; "
          f"control with auth.share_prefix_cache: {control}")
    note = (f"{trials} trials x {len(PROBES)} probes (key B reads / deletes / lists key A's session, B's "
            f"prompt with A's prefix hits A's prefix-cache pages, A's session gone after B's attempts); in "
            f"process, tiny engine; per probe {leaks}; control with auth.share_prefix_cache=true: {control}")
    return {
        "hardening.cross_tenant_leaks": entry(sum(leaks.values()), "leaks", command, note, under),
        "hardening.cross_tenant_probes": entry(attempts, "probes", command, note, under),
        "hardening.shared_cache_control_prefix_hits": entry(
            control["prefix_hit"], "hits", command, note, under
        ),
    }


def part_slowloris(command: str) -> dict:
    from hostile_clients import slowloris_body, slowloris_headers
    from local_serve_app import start_live_app

    timeout_s = 10.0  # the default http.header_timeout_s
    config = {"model": {"spec": "tiny"}, "engine": {"max_model_len": 512}, "auth": {"api_keys": [KEY_A]}}
    under = conditions()
    with start_live_app(config, num_cpus=2) as app:
        headers = slowloris_headers(app.base_url, bound_s=120)
        body = slowloris_body(app.base_url, KEY_A, bound_s=120)
    print(f"slowloris: headers held {headers.seconds:.2f}s ({headers.response[:12]!r}), body held "
          f"{body.seconds:.2f}s ({body.response[:12]!r}); default timeouts {timeout_s:g} s / 30 s")
    note = (f"raw sockets against a live local app with the default http limits: partial headers trickled "
            f"1 byte/s held {headers.seconds:.2f} s (header_timeout_s={timeout_s:g}); headers + 10 of 1000 "
            f"body bytes held {body.seconds:.2f} s (body_read_timeout_s=30); value: the header case (bound "
            f"{timeout_s:g} + 1 s)")
    return {"hardening.slowloris_held_s": entry(headers.seconds, "s", command, note, under),
            "hardening.slowloris_body_held_s": entry(body.seconds, "s", command, note, under)}


def _first_answer(base_url: str, deadline: float) -> None:
    import httpx

    body = {"model": "msaserve/smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    while time.monotonic() < deadline:
        try:
            if httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("no answer from msaserve serve")


def part_startup(command: str, port: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "import sys; from msaserve.platform.cli import main; sys.exit(main())"]
    under = conditions()
    start = time.monotonic()
    server = subprocess.Popen([*cli, "serve", "--port", str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _first_answer(f"http://127.0.0.1:{port}", start + 600)
        startup = time.monotonic() - start
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=120)
    print(f"startup: {startup:.1f}s to the first answer")
    note = ("`msaserve serve` (default app: SmolLM2-135M on CPU) from process start to the first 200 on "
            "/v1/chat/completions; where the time goes: benchmarks/reliability/startup.py")
    return {"hardening.startup_s": entry(startup, "s", command, note, under)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="fuzz,tenants,slowloris,startup")
    parser.add_argument("--fuzz-examples", type=int, default=40, help="schemathesis cases / operation / mode")
    parser.add_argument("--tenant-trials", type=int, default=20)
    parser.add_argument("--port", type=int, default=8431)
    args = parser.parse_args()
    command = "PYTHONPATH=. .venv/bin/python benchmarks/reliability/hardening.py " + " ".join(sys.argv[1:])
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    parts = args.part.split(",")
    if "fuzz" in parts:
        results.update(part_fuzz(command, args.fuzz_examples))
    if "tenants" in parts:
        results.update(part_tenants(command, args.tenant_trials))
    if "slowloris" in parts:
        results.update(part_slowloris(command))
    if "startup" in parts:
        results.update(part_startup(command, args.port))
    RESULTS.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")
    print(f"\nwrote {RESULTS}\n")
    print(f"{'figure':<36} {'value':>10}  unit        load(1m)  GEMM GFLOP/s")
    for key, e in sorted(results.items()):
        under = e["measured_under"]
        load, gemm = under["load_avg_1m"], under["gemm_gflops"]
        print(f"{key:<36} {e['value']:>10}  {e['unit']:<10}  {load:>7}  {gemm:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
