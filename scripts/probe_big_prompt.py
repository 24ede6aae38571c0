"""What one big prompt costs a running server: ``minivllm serve`` (the bundled model, on
this machine's CPU) gets a text prompt of N MB while a prober checks /health and sends a
small 8-token completion beside it. Prints, and writes to benchmarks/server_limits.json:
the big request's status and time, the longest /health wait, the small request's time,
and how much the server's peak memory grew.

    python scripts/probe_big_prompt.py --mb 5 20 50
    python scripts/probe_big_prompt.py --mb 50 --server-path /path/to/old/checkout   # a server from other code
"""
import argparse
import json
import threading
import time
from pathlib import Path

import httpx

from minivllm.testing import ServeProcess


def probe(mb: float, server_path: str | None) -> dict:
    # python -c puts the working directory first on sys.path: the server runs that checkout.
    with ServeProcess(cwd=server_path) as server:
        body = {"model": "bundled", "prompt": "It was the best of times. " * int(mb * 2**20 / 26), "max_tokens": 8}
        small = {"model": "bundled", "prompt": "It was the best of times,", "max_tokens": 8, "temperature": 0}
        httpx.post(server.url + "/v1/completions", json=small, timeout=60)  # warm
        before = server.memory_mb()
        result = {}

        def big():
            start = time.perf_counter()
            try:
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
                result["status"] = r.status_code
                result["error"] = r.json().get("error", {}).get("message", "")[:200] if r.status_code != 200 else ""
            except httpx.HTTPError as e:
                result["status"], result["error"] = None, repr(e)
            result["seconds"] = round(time.perf_counter() - start, 2)

        thread = threading.Thread(target=big)
        thread.start()
        time.sleep(0.2)  # the big body is on its way
        health_waits, small_seconds = [], None
        while thread.is_alive():
            start = time.perf_counter()
            try:
                httpx.get(server.url + "/health", timeout=600)
            except httpx.HTTPError:
                pass
            health_waits.append(time.perf_counter() - start)
            if small_seconds is None:
                start = time.perf_counter()
                httpx.post(server.url + "/v1/completions", json=small, timeout=600)
                small_seconds = time.perf_counter() - start
            time.sleep(0.05)
        thread.join()
        return {"prompt_mb": mb, **result, "max_health_wait_s": round(max(health_waits, default=0), 3),
                "small_request_s": None if small_seconds is None else round(small_seconds, 3),
                "peak_memory_growth_mb": round(server.memory_mb() - before)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, nargs="+", default=[5, 20, 50])
    parser.add_argument("--server-path", default=None, help="a checkout whose minivllm the server runs")
    parser.add_argument("--out", default="benchmarks/server_limits.json")
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args()
    rows = [probe(mb, args.server_path) for mb in args.mb]
    for row in rows:
        print(json.dumps(row))
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    report[args.label] = rows
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
