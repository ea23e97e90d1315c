"""Single-stream tokens/s: `metasd generate` vs `metasd serve` (non-stream and stream), same prompt and settings.

Each process first serves one warm-up prompt, then the measured one (suffix history is then alike in both).
Usage: python experiments/server_vs_generate.py [THREADS]   (needs the dev extras: openai, httpx)
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
from openai import OpenAI

THREADS = sys.argv[1] if len(sys.argv) > 1 else "2"
WARM, PROMPT, N = "Say hello in French.", "Explain speculative decoding in one paragraph.", 128
env = dict(os.environ, HF_HUB_OFFLINE="1")


def generate():
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.write(json.dumps({"prompt": WARM}) + "\n" + json.dumps({"prompt": PROMPT}) + "\n")
        f.flush()
        out = subprocess.run(
            ["metasd", "generate", "--prompt-file", f.name, "--json", "--max-new-tokens", str(N), "--threads", THREADS],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["stats"]["tokens_per_second"], r["stats"]["new_tokens"], r["text"]


def wait_healthy(proc, seconds=120):
    for _ in range(seconds):
        if proc.poll() is not None:
            raise RuntimeError(f"metasd serve exited with status {proc.returncode}")
        try:
            if httpx.get("http://127.0.0.1:8765/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"metasd serve not healthy after {seconds} s")


def ask(client, prompt, **options):
    """A greedy chat request for N tokens."""
    messages = [{"role": "user", "content": prompt}]
    return client.chat.completions.create(model="embedded", messages=messages, max_tokens=N, temperature=0, **options)


def serve(stream):
    proc = subprocess.Popen(
        ["metasd", "serve", "--port", "8765", "--threads", THREADS],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(proc)
        client = OpenAI(base_url="http://127.0.0.1:8765/v1", api_key="x")
        ask(client, WARM)
        start = time.perf_counter()
        if stream:
            text, usage = "", None
            for chunk in ask(client, PROMPT, stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage:
                    usage = chunk.usage
            wall = time.perf_counter() - start
            return usage.completion_tokens / wall, None, usage.completion_tokens, text
        r = ask(client, PROMPT)
        wall = time.perf_counter() - start
        inner = r.model_extra["metasd"]["tokens_per_second"]
        return r.usage.completion_tokens / wall, inner, r.usage.completion_tokens, r.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait()


for _ in range(2):
    g = generate()
    print(f"generate       tok/s {g[0]:.2f} tokens {g[1]}", flush=True)
    s = serve(False)
    print(f"serve          tok/s {s[0]:.2f} (client wall) {s[1]} (engine) tokens {s[2]} same_text {s[3] == g[2]}")
    t = serve(True)
    print(f"serve stream   tok/s {t[0]:.2f} (client wall) tokens {t[2]} same_text {t[3] == g[2]}", flush=True)
