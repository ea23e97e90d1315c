"""Throughput of `metasd serve --replicas N`: 16 concurrent clients, requests/s and tokens/s.

    python experiments/replicas_throughput.py --replicas 1 2 [--clients 16] [--requests 32] [--max-tokens 64]

For each N: starts `metasd serve --replicas N` (local Ray), waits for /health, sends one warm-up request per replica,
then `--requests` chat requests (greedy, distinct prompts) from `--clients` threads; prints one JSON line per N.
Extra arguments after `--` go to `metasd serve` (e.g. `-- --drafters ngram,suffix --policy-scope server`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def _wait(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"metasd serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError("the server never became healthy")


def _ask(url: str, prompt: str, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3600)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


def measure(replicas: int, clients: int, requests: int, max_tokens: int, port: int, extra: list[str]) -> dict:
    url = f"http://127.0.0.1:{port}"
    cmd = ["metasd", "serve", "--replicas", str(replicas), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        _wait(url, proc)
        with ThreadPoolExecutor(clients) as pool:  # warm-up: every replica decodes once, untimed
            list(pool.map(lambda i: _ask(url, f"Say hello number {i}.", 8), range(2 * replicas)))
            prompts = [f"Write a short paragraph about the number {i}." for i in range(requests)]
            start = time.perf_counter()
            tokens = list(pool.map(lambda p: _ask(url, p, max_tokens), prompts))
            wall = time.perf_counter() - start
        return {
            "replicas": replicas,
            "clients": clients,
            "requests": requests,
            "max_tokens": max_tokens,
            "wall_s": round(wall, 2),
            "requests_per_s": round(requests / wall, 3),
            "tokens_per_s": round(sum(tokens) / wall, 2),
            "completion_tokens": sum(tokens),
        }
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    for n in args.replicas:
        print(json.dumps(measure(n, args.clients, args.requests, args.max_tokens, args.port, extra)), flush=True)


if __name__ == "__main__":
    main()
