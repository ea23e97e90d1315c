"""`metasd serve` end to end: a real uvicorn on loopback, the official openai client, raw httpx for the wire format."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metasd import Decoder, Draft
from metasd.drafters.base import Drafter
from metasd.serving.app import history_key
from metasd.serving.background import running
from metasd.serving.server import create_app
from metasd.serving.stop_strings import _sendable

POOL = "ngram,suffix"
MODEL = "embedded"
KEY = "sk-metasd-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The three primary colors are"
QUESTION = "Name three fruits."


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(embedded) -> Decoder:
    """A decoder of its own, so references never race the server's worker."""
    return Decoder(drafters=POOL)


@pytest.fixture(scope="module")
def server(embedded):
    """Request-scope policies, an API key, a queue large enough for the concurrency test."""
    with running(create_app(Decoder(drafters=POOL), api_key=KEY, max_queue=32)) as url:
        yield url


@pytest.fixture(scope="module")
def small(embedded):
    """Server-scope policies, one request decoding at a time and room for one waiting; no API key. The paper's UCB
    drafts every round, so the policy's pull counts grow on any machine (the default drafts only where this
    machine's costs say it pays)."""
    decoder = Decoder(drafters=POOL, policy="metasd-ucb", policy_scope="server")
    with running(create_app(decoder, max_queue=1, max_batch=1)) as url:
        yield url


@pytest.fixture(scope="module")
def batched(embedded):
    """Two requests decoding together, room for one waiting."""
    with running(create_app(Decoder(drafters=POOL), max_queue=1, max_batch=2)) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        yield c


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def scrape(base: str) -> dict[str, float]:
    """Every sample of /metrics by name and labels, through prometheus-client's own parser."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {
        f"{s.name}{dict(sorted(s.labels.items())) or ''}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_models_and_health(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL
    assert card.model_extra["metasd"]["drafters"] == ["ngram", "suffix"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok", "model": MODEL, "waiting": 0, "running": 0}


def test_completions_equal_generate(client, reference):
    want = reference.generate(PROMPT, raw=True, max_new_tokens=16)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.stats.prompt_tokens, len(want.token_ids))
    report = got.model_extra["metasd"]
    assert report["new_tokens"] == len(want.token_ids)
    # the default policy drafts only where this machine's costs say it pays, so zero drafting rounds is possible
    assert 0 < report["rounds"] <= len(want.token_ids)
    assert sum(d["pulls"] for d in report["drafters"].values()) <= report["rounds"]  # no draft when 1 token left

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks[-2:]] == [None, want.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].model_extra["metasd"]["new_tokens"] == len(want.token_ids)


def test_chat_equals_generate(client, reference, http):
    want = reference.generate(chat(QUESTION), max_new_tokens=24)
    got = client.chat.completions.create(model=MODEL, messages=chat(QUESTION), max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=chat(QUESTION), max_tokens=24, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    body = {"messages": chat(QUESTION), "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["object"] == "chat.completion.chunk"


def test_extension_fields_pick_policy_and_drafters(client, reference):
    want = reference.generate(PROMPT, raw=True, max_new_tokens=12)
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"metasd_drafters": ["suffix"], "metasd_policy": "round-robin", "top_k": 5},
    )
    assert got.choices[0].text == want.text  # lossless whichever drafters run; top_k keeps greedy's argmax
    report = got.model_extra["metasd"]
    assert set(report["drafters"]) == {"suffix"}
    assert report["policy"]["pulls"] == {"suffix": report["drafters"]["suffix"]["pulls"]}
    assert 0 < report["drafters"]["suffix"]["pulls"] <= report["rounds"]  # round-robin drafts every round but the last


def test_null_fields_mean_defaults(http):
    body = {
        "prompt": PROMPT,
        "max_tokens": 2,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stream": None,
        "stop": None,
        "seed": None,
        "logprobs": None,
        "user": "someone",
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_stop_strings_cut_text_in_both_modes(client, reference):
    full = reference.generate(PROMPT, raw=True, max_new_tokens=24).text
    stop = full[len(full) // 2 :][:3]  # three characters from the middle of the greedy text
    expected = full[: full.find(stop)]
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": ["\u2603never", stop]}
    got = client.completions.create(**kwargs)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sendable_holds_back_partial_characters_and_stop_prefixes():
    assert _sendable("ab\ufffd\ufffd", []) == 2
    assert _sendable("say hello wo", ["world"]) == len("say hello ")
    assert _sendable("say hello w\ufffd", ["world"]) == len("say hello ")
    assert _sendable("say hello", ["world"]) == len("say hello")


def test_streams_never_split_characters(client):
    kwargs = {"model": MODEL, "prompt": "Emojis: 😀 😃 😄", "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(pieces) == whole
    assert not any("\ufffd" in p for p in pieces[:-2])  # only a final cut may leave half a character


def test_twenty_concurrent_streams_equal_sequential_references(server, reference):
    prompts = [f"Story {i}. Once upon a time" for i in range(5)] + [f"Here is a list of {i} animals:" for i in range(5)]
    prompts += [f"Name {i} animals." for i in range(2, 12)]  # 10 raw completions, then 10 chats
    want = [reference.generate(p, raw=True, max_new_tokens=8).text for p in prompts[:10]]
    want += [reference.generate(chat(p), max_new_tokens=8).text for p in prompts[10:]]
    assert len(set(want)) >= 8 and all(want)  # distinct answers: a response sent to the wrong client would show

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        if i < 10:
            stream = await c.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])
        stream = await c.chat.completions.create(
            model=MODEL, messages=chat(prompts[i]), max_tokens=8, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(20)))

    assert asyncio.run(all_at_once()) == want


BAD_INPUTS = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "metasd_policy": "fixed:nowhere"}, 400, None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 9000}, 400, "prompt"),  # longer than the context by itself
    ("/v1/chat/completions", {"messages": chat("hi"), "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "metasd_policy": "psychic"}, 400, None),
    ("/v1/completions", {"prompt": "hi", "metasd_drafters": ["early-exit"], "stream": True}, 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS, ids=[str(b)[:40] for _, b, *_ in BAD_INPUTS])
def test_bad_input_is_a_4xx_in_openai_shape_and_the_server_keeps_serving(http, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_context_errors_carry_openai_code(http):
    for body in ({"prompt": [1] * 9000}, {"prompt": "hi", "max_tokens": 10**6}):
        assert http.post("/v1/completions", json=body).json()["error"]["code"] == "context_length_exceeded"


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200  # probes and scrapers need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--max-queue", "0"],
        ["--api-key", ""],
        ["--api-key", "a,"],
        ["--max-body-bytes", "0"],
        ["--history-scope", "per-key"],
        ["--history-scope", "off", "--policy-scope", "server"],
    ],
)
def test_serve_rejects_bad_options_before_loading_models(argv, capsys, monkeypatch):
    from metasd.cli import main

    monkeypatch.delenv("METASD_API_KEY", raising=False)

    assert main(["serve", *argv]) == 2
    assert "metasd: error:" in capsys.readouterr().err


def test_metrics_count_what_was_served(server, http):
    before = scrape(server)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).json()
    http.post("/v1/completions", json={"prompt": "hi", "n": 3})
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    report = r["metasd"]
    assert delta("metasd:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("metasd:generation_tokens_total") == r["usage"]["completion_tokens"]
    assert delta("metasd:spec_decode_num_rounds_total") == report["rounds"]
    assert delta("metasd:spec_decode_num_switches_total") == report["switches"]
    assert delta(f"metasd:request_success_total{{'finished_reason': '{r['choices'][0]['finish_reason']}'}}") == 1
    assert delta("metasd:request_failure_total{'status': '400'}") == 1
    assert delta("metasd:e2e_request_latency_seconds_count") == 1
    for name in ("ngram", "suffix"):
        d = report["drafters"].get(name, {"pulls": 0, "drafted": 0, "accepted": 0})
        assert delta(f"metasd:spec_decode_num_drafts_total{{'drafter': '{name}'}}") == d["pulls"]
        assert delta(f"metasd:spec_decode_num_draft_tokens_total{{'drafter': '{name}'}}") == d["drafted"]
        assert delta(f"metasd:spec_decode_num_accepted_tokens_total{{'drafter': '{name}'}}") == d["accepted"]
    assert after["metasd:num_requests_running"] == 0


def test_full_queue_answers_429_and_a_disconnect_frees_the_engine(small):
    long = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 2000, "temperature": 0, "stream": True}
    short = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    aborted = scrape(small).get("metasd:request_success_total{'finished_reason': 'abort'}", 0.0)
    with (
        httpx.Client(base_url=small, timeout=60) as a,
        httpx.Client(base_url=small, timeout=60) as b,
        ThreadPoolExecutor(1) as pool,
    ):
        with a.stream("POST", "/v1/completions", json=long) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # decoding has started
            waiting = pool.submit(b.post, "/v1/completions", json=short)
            deadline = time.monotonic() + 30
            while httpx.get(f"{small}/health", timeout=5).json()["waiting"] < 1:  # answers while decoding
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.05)
            r = httpx.post(f"{small}/v1/completions", json=short, timeout=30)
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "queue_full" and "busy" in r.json()["error"]["message"]
        # leaving the block hung up mid-stream: the long generation must stop and the queued request run
        assert waiting.result(timeout=60).status_code == 200
    metrics = scrape(small)
    assert metrics["metasd:request_success_total{'finished_reason': 'abort'}"] == aborted + 1
    assert metrics["metasd:num_requests_running"] == 0 and metrics["metasd:num_requests_waiting"] == 0
    assert httpx.post(f"{small}/v1/completions", json=short, timeout=60).status_code == 200


def test_a_request_being_checked_still_counts_as_waiting(embedded):
    """The worker takes a queued request off the queue to check it (tokenize, size); while it does, the request
    is still waiting, and a full queue must still answer 429."""
    decoder = Decoder(drafters=POOL)
    encode, entered, release = decoder.encode, threading.Event(), threading.Event()

    def held_encode(prompt, raw):
        if prompt == "hold":
            entered.set()
            assert release.wait(60)
        return encode(prompt, raw)

    decoder.encode = held_encode
    short = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with running(create_app(decoder, max_queue=1, max_batch=1)) as url, ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{url}/v1/completions", json={**short, "prompt": "hold"}, timeout=60)
        assert entered.wait(30)
        try:
            assert httpx.get(f"{url}/health", timeout=5).json()["waiting"] == 1
            r = httpx.post(f"{url}/v1/completions", json=short, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        finally:
            release.set()
        assert held.result(timeout=60).status_code == 200
        assert httpx.get(f"{url}/health", timeout=5).json()["waiting"] == 0
        assert httpx.post(f"{url}/v1/completions", json=short, timeout=60).status_code == 200


def test_a_client_leaving_the_queue_gives_its_place_back_at_once(small):
    long = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 2000, "temperature": 0, "stream": True}
    short = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=small, timeout=60) as a, a.stream("POST", "/v1/completions", json=long) as streaming:
        lines = streaming.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # decoding has started, the batch is full
        with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, then hangs up
            httpx.post(f"{small}/v1/completions", json=short, timeout=2)
        deadline = time.monotonic() + 30
        while httpx.get(f"{small}/health", timeout=5).json()["waiting"]:  # while the stream still decodes
            assert time.monotonic() < deadline, "a client that left still holds its place in the queue"
            time.sleep(0.05)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(httpx.post, f"{small}/v1/completions", json=short, timeout=60)
            while httpx.get(f"{small}/health", timeout=5).json()["waiting"] < 1:  # queued, not refused with 429
                assert not queued.done(), queued.result().text
                time.sleep(0.05)
            streaming.close()  # the stream hangs up: the queued request decodes
            assert queued.result(timeout=60).status_code == 200


class _EndFails(Drafter):
    """A free drafter that never proposes, whose `end` raises while `failures` is positive (shared by the copies a
    batch makes for each request)."""

    name = "ends-badly"

    def __init__(self):
        self.failures = [0]

    def begin(self, prompt):
        pass

    def propose(self, context, k, params, generator):
        return Draft([])

    def end(self, context):
        if self.failures[0] > 0:
            self.failures[0] -= 1
            raise RuntimeError("a drafter's end failed")


@pytest.mark.parametrize("how", ["length", "stop-string"])
def test_a_request_whose_leaving_raises_fails_alone_and_the_worker_goes_on(embedded, reference, how):
    """A drafter's `end` raising while a request leaves the batch (it reached max_tokens, or a stop string cut it):
    that request gets 500, the batch keeps no request nobody tracks, and the next requests are served."""
    drafter = _EndFails()
    decoder = Decoder(drafters=["ngram", drafter])
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    if how == "stop-string":
        text = reference.generate(PROMPT, max_new_tokens=12, raw=True, drafters=["ngram"]).text
        body["stop"] = [text.split()[1]]  # a word inside the output: the server cuts the request there
    with running(create_app(decoder, max_queue=4, max_batch=2)) as url:
        drafter.failures[0] = 1
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "a drafter's end failed" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
        with ThreadPoolExecutor(2) as pool:  # two together, then the batch is empty again
            replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60), range(2)))
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["status"] == "ok" and health["running"] == 0, health


def test_a_bug_detokenizing_one_request_fails_it_alone(embedded):
    decoder = Decoder(drafters=POOL)
    decode, broken = decoder.decode, threading.Event()

    def decode_or_fail(ids):
        if broken.is_set():
            raise RuntimeError("detokenizing failed")
        return decode(ids)

    decoder.decode = decode_or_fail
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with running(create_app(decoder, max_queue=4)) as url:
        broken.set()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "detokenizing failed" in r.json()["error"]["message"], r.text
        broken.clear()
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_full_batch_queues_then_answers_429_and_bad_input_still_gets_its_4xx(batched):
    long = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 2000, "temperature": 0, "stream": True}
    short = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with (
        httpx.Client(base_url=batched, timeout=60) as a,
        httpx.Client(base_url=batched, timeout=60) as b,
        httpx.Client(base_url=batched, timeout=60) as c,
        ThreadPoolExecutor(1) as pool,
    ):
        with (
            a.stream("POST", "/v1/completions", json=long) as first,
            b.stream("POST", "/v1/completions", json=long) as second,
        ):
            lines = [first.iter_lines(), second.iter_lines()]  # kept: a dropped iterator closes its stream
            for stream_lines in lines:
                assert next(line for line in stream_lines if line.startswith("data: "))
            # the worker checks a request's size against the context while others decode
            bad = httpx.post(f"{batched}/v1/completions", json={**short, "max_tokens": 10**6}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
            assert httpx.get(f"{batched}/health", timeout=5).json()["running"] == 2  # both decode, in one batch
            waiting = pool.submit(c.post, "/v1/completions", json=short)
            deadline = time.monotonic() + 30
            while httpx.get(f"{batched}/health", timeout=5).json()["waiting"] < 1:
                assert time.monotonic() < deadline, "the third request never queued"
                time.sleep(0.05)
            r = httpx.post(f"{batched}/v1/completions", json=short, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            bad = httpx.post(f"{batched}/v1/completions", json={**short, "temperature": 5}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"  # also past a full queue
        # both streams hung up: the batch empties and the queued request decodes
        assert waiting.result(timeout=60).status_code == 200
    metrics = scrape(batched)
    assert metrics["metasd:num_requests_running"] == 0
    assert metrics["metasd:batch_size_count"] > 0 and metrics["metasd:batch_size_sum"] >= 2 * 2  # rounds of two
    assert any(name.startswith("metasd:spec_decode_num_draft_tokens_by_batch_size_total") for name in metrics)


def test_a_client_leaving_a_non_streaming_request_stops_it(small):
    def aborted() -> float:
        return scrape(small).get("metasd:request_success_total{'finished_reason': 'abort'}", 0.0)

    before = aborted()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(
            f"{small}/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 2000, "temperature": 0}, timeout=1
        )
    deadline = time.monotonic() + 30
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the abandoned generation kept running"
        time.sleep(0.1)
    assert httpx.get(f"{small}/health").json()["running"] == 0


def test_policy_scope_server_keeps_learning_and_request_scope_resets(small, http):
    def run(base: str, prompt: str) -> dict:
        r = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": prompt, "max_tokens": 16, "temperature": 0},
            headers=AUTH,
            timeout=60,
        )
        return r.json()["metasd"]

    first, second = run(small, PROMPT), run(small, "Once upon a time")
    own = {n: second["drafters"].get(n, {"pulls": 0})["pulls"] for n in ("ngram", "suffix")}
    assert sum(own.values()) > 0
    assert second["policy"]["scope"] == "server"
    assert second["policy"]["pulls"] == {n: first["policy"]["pulls"][n] + own[n] for n in own}

    fresh = run(str(http.base_url).rstrip("/"), "Once upon a time")
    assert fresh["policy"]["scope"] == "request"
    assert fresh["policy"]["pulls"] == {n: fresh["drafters"].get(n, {"pulls": 0})["pulls"] for n in own}


# --- hardening: every request ends quickly with a clear answer and none stalls the others ---------------

STRICT_TEMPLATE = (  # as strict templates do (Mistral's, Gemma's): user and assistant turns must alternate
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)
KEYS = ("sk-alice", "sk-bob")


@pytest.fixture(scope="module")
def strict(embedded):
    """Two API keys with suffix histories per key, a 64 KiB body limit, a strict chat template, and a count of the
    prompts the worker tokenized."""
    import copy

    decoder = Decoder(drafters=POOL)
    decoder.tokenizer = copy.deepcopy(decoder.tokenizer)
    decoder.tokenizer.chat_template = STRICT_TEMPLATE
    encoded = []
    encode = decoder.encode
    decoder.encode = lambda prompt, raw=False: encoded.append(prompt) or encode(prompt, raw)
    app = create_app(decoder, api_key=",".join(KEYS), max_body_bytes=65536, history_scope="per-key")
    with running(app) as url:
        yield url, encoded


def key(name: str) -> dict:
    return {"Authorization": f"Bearer {name}"}


def timed_post(base: str, path: str, headers: dict | None = None, **kwargs) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(f"{base}{path}", headers={**AUTH, **(headers or {})}, timeout=60, **kwargs)
    return r, time.monotonic() - start


def test_tiny_temperature_is_greedy_not_nan(server, reference):
    want = reference.generate(PROMPT, raw=True, max_new_tokens=8).text
    for temperature in (1e-40, 5e-324, 9e-6, 0.5):  # 0.5 with top_p 1e-300: sampling from the top token alone
        r, took = timed_post(
            server,
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 8, "temperature": temperature, "top_p": 1e-300},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want and took < 30


def test_body_over_the_limit_is_413_before_parsing(strict):
    base, encoded = strict
    prompt = {"prompt": "x" * 100_000, "max_tokens": 1}
    r, took = timed_post(base, "/v1/completions", key(KEYS[0]), json=prompt)  # with a Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large" and took < 5

    def chunked():  # no Content-Length: refused while reading
        for _ in range(100):
            yield b" " * 1000

    r, took = timed_post(
        base, "/v1/completions", {**key(KEYS[0]), "Content-Type": "application/json"}, content=chunked()
    )
    assert r.status_code == 413 and took < 5
    assert not encoded
    ok, _ = timed_post(base, "/v1/completions", key(KEYS[0]), json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_post_without_json_content_type_is_415(server, content_type):
    """Browsers send these cross-site without a CORS preflight: a web page must not drive a local server."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with httpx.Client(base_url=server, timeout=30) as c:
        r = c.post("/v1/completions", content=body, headers={**AUTH, **headers})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        json_type = {"Content-Type": "application/json; charset=utf-8"}
        ok = c.post("/v1/completions", content=body, headers={**AUTH, **json_type})
        assert ok.status_code == 200


def test_over_long_prompt_is_refused_by_length_before_tokenizing(server, reference):
    from metasd.serving.protocol import _max_prompt_chars

    bound = _max_prompt_chars(reference.tokenizer, reference.target.max_length)
    assert bound >= reference.target.max_length * max(map(len, reference.tokenizer.get_vocab()))
    for path, body in (
        ("/v1/completions", {"prompt": "a" * (bound + 1), "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": chat("a" * (bound + 1)), "max_tokens": 1}),
        ("/v1/completions", {"prompt": [1] * 200_000, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": chat("a") * 9000, "max_tokens": 1}),
    ):
        r, took = timed_post(server, path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert took < 5


def test_the_worker_never_tokenizes_a_prompt_refused_by_length(strict):
    base, encoded = strict
    encoded.clear()
    r, _ = timed_post(base, "/v1/completions", key(KEYS[0]), json={"prompt": [5] * 9000, "max_tokens": 1})
    assert r.status_code == 400 and not encoded


def _policy_bounded() -> bool:
    """build_policy refuses a huge budget quickly; probed in a child with capped memory, since an unbounded one
    builds a schedule of billions of entries."""
    import subprocess
    import sys

    probe = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from metasd.policy import build_policy\n"
        "try:\n    build_policy('sequential-halving:4000000000', ['a', 'b'])\nexcept ValueError:\n    print('ok')"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return done.stdout.strip() == "ok"


def test_huge_policy_parameter_is_a_fast_400(server):
    if not _policy_bounded():
        pytest.fail(
            "build_policy does not refuse sequential-halving:4000000000 with a ValueError (policies.py must "
            "bound client-chosen parameters); not sent to the server, which would run out of memory"
        )
    for policy in ("sequential-halving:4000000000", "metasd-ucb:1e308", "exp3:nan"):
        r, took = timed_post(server, "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "metasd_policy": policy})
        assert r.status_code == 400 and took < 5, (policy, r.text)


def test_sendable_is_linear_in_the_stop_length():
    stop = "a" * 255 + "b"
    text = "a" * 100_000
    start = time.perf_counter()
    for _ in range(100):
        assert _sendable(text, [stop] * 4) == 100_000 - 255
    assert time.perf_counter() - start < 1.0  # slicing per prefix length: ~30k character comparisons per call


def test_sendable_agrees_with_the_quadratic_definition():
    import random

    def naive(text: str, stops: list[str]) -> int:
        end = len(text.rstrip("\ufffd"))
        return end - max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k], 0, end)), default=0)

    rng = random.Random(1)
    for _ in range(3000):
        text = "".join(rng.choice("ab\ufffd") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(0, 3))]
        assert _sendable(text, stops) == naive(text, stops), (text, stops)


def test_long_stop_strings_are_refused(server):
    r, took = timed_post(server, "/v1/completions", json={"prompt": "hi", "stop": ["ok", "z" * 100_000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and took < 5


def test_chat_template_errors_are_400(strict):
    base, _ = strict
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    r, took = timed_post(base, "/v1/chat/completions", key(KEYS[0]), json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and took < 10, r.text
    assert "alternate" in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"
    ok, _ = timed_post(base, "/v1/chat/completions", key(KEYS[0]), json={"messages": chat("hi"), "max_tokens": 1})
    assert ok.status_code == 200


def test_history_per_key_keeps_clients_apart(strict):
    base, _ = strict
    body = {
        "prompt": "My secret plan is",
        "max_tokens": 16,
        "temperature": 0,
        "metasd_drafters": ["suffix"],
        "metasd_policy": "fixed:suffix",
    }

    def accepted(who: str) -> int:
        r, _ = timed_post(base, "/v1/completions", key(who), json=body)
        assert r.status_code == 200, r.text
        return r.json()["metasd"]["drafters"]["suffix"]["accepted"]

    alice_first = accepted(KEYS[0])
    assert accepted(KEYS[0]) > alice_first  # alice's own earlier output is drafted back
    assert accepted(KEYS[1]) == alice_first  # bob sees none of it: as if no history existed
    assert httpx.get(f"{base}/v1/models", headers=key(KEYS[1])).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers=key("sk-eve")).status_code == 401


def test_a_clients_history_key_is_its_own_whatever_the_keys_order():
    one, two = history_key("sk-alice"), history_key("sk-bob")
    assert one != two and one == history_key("sk-alice") and one.startswith("key-")
    assert "alice" not in one and len(one) == len("key-") + 16  # a hash: the key is never written out


def test_history_scope_options_are_checked(embedded):
    decoder = Decoder(drafters=POOL)
    with pytest.raises(ValueError, match="needs API keys"):
        create_app(decoder, history_scope="per-key")
    with pytest.raises(ValueError, match="history_scope"):
        create_app(decoder, history_scope="everyone")
    with pytest.raises(ValueError, match="policy scope"):
        create_app(Decoder(drafters=POOL, policy_scope="server"), api_key="k", history_scope="off")
    with pytest.raises(ValueError, match="empty"):
        create_app(decoder, api_key="a,,b")
    with pytest.raises(ValueError, match="max_batch"):
        create_app(decoder, max_batch=0)


def test_incremental_text_equals_a_whole_decode(embedded):
    """The server decodes a few tokens a round; the text must equal decoding the whole output, multi-byte
    characters and words split over tokens included, and never show half a character."""
    from metasd.serving.detokenize import IncrementalText

    tok = embedded.tokenizer
    texts = ["Hello, world! Ça va? 日本語のテキスト 🙂🙂 end", "  leading spaces\nand\ttabs  ", "naïve café — “quotes”"]
    for text in texts:
        ids = tok(text)["input_ids"]
        detok = IncrementalText(lambda t: tok.decode(t, skip_special_tokens=True))
        for n in range(1, len(ids) + 1):
            partial = detok.update(ids[:n])
            assert "\ufffd" not in partial
            assert tok.decode(ids[:n], skip_special_tokens=True).startswith(partial)
        assert detok.finish(ids) == tok.decode(ids, skip_special_tokens=True)


def test_a_request_never_calibrates_beyond_the_range_calibrated_at_start(server, monkeypatch):
    """metasd-adaptive:max=K past what the server calibrated at start is a fast 400: a request must never
    recalibrate T(M) in the one decoding thread (seconds for everyone queued, kernels re-routed for all, the online
    T(M) estimates dropped). A shorter max is served without calibrating."""
    import metasd.costs.calibration
    from metasd.policy.adaptive import DEFAULTS

    calibrated = []

    def no_calibration(spec, model, max_tokens, **kwargs):
        calibrated.append(max_tokens)
        raise AssertionError("a request calibrated T(M)")

    monkeypatch.setattr(metasd.costs.calibration, "load_or_calibrate", no_calibration)
    for policy in ("metasd-adaptive:max=64", f"metasd-adaptive:max={DEFAULTS['max'] + 1}"):
        body = {"prompt": "hi", "max_tokens": 2, "metasd_policy": policy}
        r, took = timed_post(server, "/v1/completions", json=body)
        assert r.status_code == 400 and took < 5, (policy, r.text)
        assert "calibrated" in r.json()["error"]["message"], r.text
    body = {"prompt": "hi", "max_tokens": 2, "metasd_policy": "metasd-adaptive:max=4"}
    assert timed_post(server, "/v1/completions", json=body)[0].status_code == 200
    assert calibrated == []


class _Killed(BaseException):
    """What the worker's `except Exception` lets through (as a fatal error in native code would kill it)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_decoding_thread_answers_503_at_once_and_fails_queued_requests(embedded):
    app = create_app(Decoder(drafters=POOL), max_queue=4)
    entered, release = threading.Event(), threading.Event()

    def dies(job, gen) -> None:
        entered.set()
        release.wait(30)
        raise _Killed("the decoding thread dies")

    app.state.engine._join = dies
    body = {"prompt": PROMPT, "max_tokens": 4}
    with running(app) as url, ThreadPoolExecutor(2) as pool:

        def post() -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=15)

        serving = pool.submit(post)
        assert entered.wait(30)
        queued = pool.submit(post)
        deadline = time.monotonic() + 15
        while httpx.get(f"{url}/health", timeout=5).json()["waiting"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        release.set()
        for future in (serving, queued):  # the one it was serving and the one queued behind it: not left hanging
            r = future.result(timeout=30)
            assert r.status_code == 503 and "decoding thread" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        start = time.monotonic()
        r = post()
        assert r.status_code == 503 and time.monotonic() - start < 5, r.text
