"""Benchmark `powerinfer server` under concurrent streaming clients.

Starts a server in a subprocess (or uses --url), then for each client count runs that many clients at once,
each streaming one /completion of --n-predict tokens (greedy, ignore_eos, distinct prompts).
Reports per level:
TTFT p50/p95 (request sent -> first token, queue wait included), inter-token latency p50/p95 (gaps between
streamed events), and aggregate generated tokens/s (all tokens / wall time of the level).

    python scripts/bench_server.py -m model.gguf -np 8 --clients 1,4,8,16 -n 32 -t 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

TOPICS = [
    "a lighthouse",
    "the moon",
    "a lost key",
    "winter",
    "a robot",
    "the sea",
    "a small town",
    "coffee",
    "a library",
    "mountains",
    "a train",
    "music",
    "a garden",
    "rain",
    "an old map",
    "the desert",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def one_request(host: str, port: int, prompt: str, n_predict: int, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/completion", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"{resp.status} {resp.read()[:200]!r}"}
    times: list[float] = []
    n_tokens = 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return {"error": event["error"]["message"]}
        if event.get("stop"):
            n_tokens = event["tokens_predicted"]
            break
        if event.get("content"):
            times.append(time.perf_counter())
    conn.close()
    end = time.perf_counter()
    return {
        "ttft": times[0] - t0 if times else float("nan"),
        "gaps": [b - a for a, b in zip(times, times[1:], strict=False)],
        "tokens": n_tokens,
        "start": t0,
        "end": end,
    }


def run_level(host: str, port: int, clients: int, n_predict: int, api_key: str | None) -> dict:
    results: list[dict] = [{}] * clients

    def client(i: int) -> None:
        prompt = f"Write a short story about {TOPICS[i % len(TOPICS)]} (version {i}):"
        results[i] = one_request(host, port, prompt, n_predict, api_key)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok]
    return {
        "clients": clients,
        "ok": len(ok),
        "errors": errors,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p95_ms": 1e3 * percentile(ttft, 0.95),
        "itl_p50_ms": 1e3 * percentile(gaps, 0.5),
        "itl_p95_ms": 1e3 * percentile(gaps, 0.95),
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "powerinfer",
        "server",
        "--port",
        str(port),
        "-np",
        str(args.parallel),
        "-c",
        str(args.ctx_size),
        "-t",
        str(args.threads),
        "--max-queue",
        "64",
    ]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}: {' '.join(cmd)}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="model file (default: the server's default model)")
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("POWERINFER_API_KEY"))
    ap.add_argument("-np", "--parallel", type=int, default=8, help="server slots")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per request")
    ap.add_argument("--clients", default="1,4,8,16", help="comma-separated client counts")
    ap.add_argument("--json", action="store_true", help="print one JSON object per level")
    args = ap.parse_args()

    proc = None
    if args.url:
        u = urlparse(args.url)
        host, port = u.hostname or "127.0.0.1", u.port or 80
    else:
        proc, port = start_server(args)
        host = "127.0.0.1"
    try:
        one_request(host, port, "warm up", 2, args.api_key)
        rows = []
        for clients in (int(c) for c in args.clients.split(",")):
            row = run_level(host, port, clients, args.n_predict, args.api_key)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"clients {row['clients']:3d}: {row['tokens_per_s']:7.2f} tok/s  "
                    f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms p95 {row['ttft_p95_ms']:8.1f} ms  "
                    f"ITL p50 {row['itl_p50_ms']:7.1f} ms p95 {row['itl_p95_ms']:7.1f} ms  "
                    f"({row['ok']} ok, {len(row['errors'])} errors, {row['tokens']} tokens in "
                    f"{row['wall_s']:.1f} s)",
                    flush=True,
                )
        if not args.json and rows and rows[0]["tokens_per_s"] > 0:
            base = rows[0]["tokens_per_s"]
            print(
                "scaling vs 1 client: "
                + ", ".join(f"{r['clients']}: {r['tokens_per_s'] / base:.2f}x" for r in rows),
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
