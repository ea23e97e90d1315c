"""Scale-out on Ray: `bench --ray` against the one-process run, a worker killed mid-run, `--resume`, and
`serve --replicas` answering the openai client with pooled bandit statistics.

Marked `ray` (excluded by default; `.ci/run` installs the [ray] extra and runs `pytest -m ray`). One local Ray
instance with 2 CPUs serves the whole module.
"""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

MAX_NEW = 8


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(questions_path: Path, out: Path):
    from metasd.bench.config import BenchConfig

    return BenchConfig(
        questions=questions_path,
        out=out,
        categories=["summarization", "qa"],
        per_category=1,
        max_new_tokens=MAX_NEW,
        methods=["ar", "fixed:ngram"],
        drafters="ngram,suffix",
        warmup=False,
        progress=False,
        plots=False,
        threads=1,
    )


def _answers(out: Path) -> dict:
    """method -> question id -> per-turn texts, from the Spec-Bench answer files."""
    found = {}
    for path in sorted((out / "answers").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            found.setdefault(item["model_id"], {})[item["question_id"]] = item["choices"][0]["turns"]
    return found


@pytest.fixture(scope="module")
def one_process(questions_path: Path, tmp_path_factory) -> tuple[dict, Path]:
    from metasd.bench.run import run_bench

    out = tmp_path_factory.mktemp("one")
    return run_bench(_cfg(questions_path, out)), out


def test_two_workers_match_one_process(local_ray, one_process, questions_path: Path, tmp_path: Path) -> None:
    from metasd.bench.distributed import ClusterOptions, run_distributed

    reference, ref_out = one_process
    summary = run_distributed(_cfg(questions_path, tmp_path), ClusterOptions("local", workers=2, worker_cpus=1))
    assert list(summary["methods"]) == list(reference["methods"]) == ["ar", "fixed:ngram"]
    assert [q["question_id"] for q in summary["questions"]] == [q["question_id"] for q in reference["questions"]]
    assert summary["correctness"]["mismatches"] == 0
    assert _answers(tmp_path) == _answers(ref_out)
    cluster = summary["config"]["cluster"]
    assert cluster["mode"] == "ray" and cluster["workers"] == 2 and not cluster["retries"]
    assert {q["ran_on"]["worker"] for q in summary["questions"]} == {0, 1}
    assert all(q["ran_on"]["hostname"] and q["ran_on"]["node_id"] for q in summary["questions"])
    assert all(h["cpu"] for h in cluster["hosts"])
    assert (tmp_path / "report.md").read_text(encoding="utf-8").count("## Where questions ran") == 1
    assert len(list((tmp_path / "partial").glob("q*.pkl"))) == 2


def test_killed_worker_loses_no_question_and_resume_skips_finished(
    local_ray, one_process, questions_path: Path, tmp_path: Path, monkeypatch
) -> None:
    from metasd.bench.distributed import KILL_ENV, ClusterOptions, run_distributed

    reference, ref_out = one_process
    monkeypatch.setenv(KILL_ENV, "0")  # worker 0 dies on its first question
    summary = run_distributed(_cfg(questions_path, tmp_path), ClusterOptions("local", workers=2, worker_cpus=1))
    monkeypatch.delenv(KILL_ENV)
    cluster = summary["config"]["cluster"]
    assert [q["question_id"] for q in summary["questions"]] == [q["question_id"] for q in reference["questions"]]
    assert summary["correctness"]["mismatches"] == 0
    assert len(cluster["retries"]) == 1 and cluster["workers_lost"][0]["worker"] == 0
    retried = cluster["retries"][0]["question_id"]
    ran = {q["question_id"]: q["ran_on"] for q in summary["questions"]}
    assert ran[retried]["attempt"] == 2 and ran[retried]["worker"] == 1
    assert "died; measured again" in (tmp_path / "report.md").read_text(encoding="utf-8")
    assert _answers(tmp_path) == _answers(ref_out)

    # --resume (in process): one question's result removed, only that one is measured again
    partial = tmp_path / "partial"
    kept, dropped = sorted(partial.glob("q*.pkl"))
    kept_mtime = kept.stat().st_mtime_ns
    dropped.unlink()
    resumed = run_distributed(_cfg(questions_path, tmp_path), ClusterOptions(None, resume=True))
    assert resumed["config"]["cluster"]["resumed_questions"] == 1
    assert kept.stat().st_mtime_ns == kept_mtime and dropped.is_file()
    assert resumed["correctness"]["mismatches"] == 0
    assert _answers(tmp_path) == _answers(ref_out)

    # a different run in the same folder is refused, not mixed in
    other = _cfg(questions_path, tmp_path)
    other.max_new_tokens = MAX_NEW + 1
    with pytest.raises(ValueError, match="different run"):
        run_distributed(other, ClusterOptions(None, resume=True))


def test_policy_sync_shares_statistics_between_replicas() -> None:
    from metasd.engine import Decoder
    from metasd.serving.ray_replicas import PolicyHub, PolicySync

    hub = PolicyHub()
    a = Decoder(drafters="ngram,suffix", policy="metasd-ucb", policy_scope="server")
    b = Decoder(drafters="ngram,suffix", policy="metasd-ucb", policy_scope="server")
    sync_a, sync_b = PolicySync(a, hub.merge, 0.0), PolicySync(b, hub.merge, 0.0)
    a.generate("Repeat: one two three one two three one two three", max_new_tokens=12)
    learned = dict(a.policies)
    ((key, policy_a),) = learned.items()
    assert sum(policy_a.state()["pulls"]) > 0
    sync_a.sync()
    sync_b.sync()  # b had never served with this policy (made at construction): it adopts the pooled statistics
    policy_b = b.policies[key]
    assert policy_b.state() == policy_a.state()
    b.generate("Count: 1 2 3 1 2 3 1 2 3", max_new_tokens=12)
    sync_b.sync()
    sync_a.sync()
    total = hub.totals[key]
    assert policy_a.state()["pulls"] == policy_b.state()["pulls"] == total["pulls"]
    assert policy_a.state()["rounds"] == total["rounds"]
    assert policy_a.mean_rewards == pytest.approx(policy_b.mean_rewards)


def _ucb(policy_scope: str = "server"):
    from metasd.engine import Decoder

    return Decoder(drafters="ngram,suffix", policy="metasd-ucb", policy_scope=policy_scope)


def _counts(policy) -> tuple[list[int], int]:
    state = policy.state()
    return state["pulls"], state["rounds"]


def _plus(*counts: tuple[list[int], int]) -> tuple[list[int], int]:
    return [sum(arm) for arm in zip(*(c[0] for c in counts), strict=True)], sum(c[1] for c in counts)


def _minus(a: tuple[list[int], int], b: tuple[list[int], int]) -> tuple[list[int], int]:
    return [x - y for x, y in zip(a[0], b[0], strict=True)], a[1] - b[1]


def test_a_policy_evicted_and_made_again_never_lowers_the_pool(monkeypatch) -> None:
    """The decoder's policy cache evicts a key; a request makes its policy again, from zero, and learns less than
    the pool held before the next sync: that must add to the pool, not push a negative difference."""
    import metasd.engine
    from metasd.serving.ray_replicas import PolicyHub, PolicySync

    hub = PolicyHub()
    a = _ucb()
    sync = PolicySync(a, hub.merge, 0.0)
    a.generate("Repeat: one two three one two three one two three", max_new_tokens=24)
    ((key, first),) = a.policies.items()
    sync.sync()
    pooled = _counts(first)
    monkeypatch.setattr(metasd.engine, "_POLICY_CACHE", 1)
    a.generate("Count: 1 2 3 1 2 3", max_new_tokens=4, policy="metasd-ucb:0.5")  # evicts `key`
    assert key not in a.policies
    a.generate("Count: 1 2 3 1 2 3", max_new_tokens=4)  # made again from zero
    again = a.policies[key]
    assert again is not first and sum(_counts(again)[0]) < sum(pooled[0])
    learned = _counts(again)
    sync.sync()
    total = hub.totals[key]
    assert (total["pulls"], total["rounds"]) == _plus(pooled, learned)
    assert _counts(again) == _plus(pooled, learned)  # and the new policy adopted the pool


def test_the_hub_refuses_statistics_that_would_lower_a_count() -> None:
    from metasd.serving.ray_replicas import PolicyHub

    hub = PolicyHub()
    key = ("metasd-ucb:1.0", ("ngram", "suffix"), "greedy")
    hub.merge("r1", {key: {"policy": 0, "pulls": [3, 2], "sums": [1.5, 1.0], "rounds": 5}})
    for pulls, rounds in (([1, 2], 5), ([3, 2], 4)):  # the same policy again, with fewer pulls or rounds
        reply = hub.merge("r1", {key: {"policy": 0, "pulls": pulls, "sums": [0.5, 1.0], "rounds": rounds}})
        assert reply["totals"][key]["pulls"] == [3, 2] and reply["totals"][key]["rounds"] == 5
    hub.merge("r2", {key: {"policy": 0, "pulls": [-1, 0], "sums": [0.0, 0.0], "rounds": 0}})  # negative
    assert hub.totals[key]["pulls"] == [3, 2] and hub.refused == 3


def test_the_hub_is_bounded_and_answers_only_the_keys_pushed() -> None:
    from metasd.serving.ray_replicas import PolicyHub

    hub = PolicyHub(max_keys=4)
    for i in range(10):
        key = (f"metasd-ucb:{i}.0", ("ngram", "suffix"), "greedy")
        reply = hub.merge(f"r{i}", {key: {"policy": 0, "pulls": [1, 1], "sums": [0.5, 0.5], "rounds": 2}})
        assert list(reply["totals"]) == [key]
    assert len(hub.totals) == 4 and ("metasd-ucb:9.0", ("ngram", "suffix"), "greedy") in hub.totals


def test_a_replica_adopts_only_the_keys_it_holds() -> None:
    """Another replica's policies are not made here (each sync would otherwise make, and evict, every key the
    hub ever saw); the key this replica holds gets the pool."""
    from metasd.engine import Decoder
    from metasd.serving.ray_replicas import PolicyHub, PolicySync

    hub = PolicyHub()
    a = _ucb()
    b = Decoder(drafters="ngram,suffix", policy="metasd-fi", policy_scope="server")
    sync_a, sync_b = PolicySync(a, hub.merge, 0.0), PolicySync(b, hub.merge, 0.0)
    a.generate("Repeat: one two three one two three", max_new_tokens=8)
    b.generate("Count: 1 2 3 1 2 3", max_new_tokens=8, policy="metasd-ucb", temperature=0.5, seed=0)
    held = list(b.policies)
    sync_a.sync()
    sync_b.sync()
    assert list(b.policies) == held  # a's greedy metasd-ucb key is not made in b
    ((key, policy_a),) = a.policies.items()
    assert key not in b.policies and sum(policy_a.state()["pulls"]) > 0


def test_a_restarted_hub_counts_each_replicas_learning_exactly_once() -> None:
    """Replicas pushed to a hub that then restarted empty: the new hub must be rebuilt from what each replica learned
    itself, each counted once (not deltas against a lost base, nor every replica's copy of the old pool), and every
    replica adopts the new hub's totals."""
    from metasd.serving.ray_replicas import PolicyHub, PolicySync

    hubs = [PolicyHub()]

    def merge(*args):
        return hubs[-1].merge(*args)

    a, b = _ucb(), _ucb()
    sync_a, sync_b = PolicySync(a, merge, 0.0), PolicySync(b, merge, 0.0)
    ((key, policy_a),) = a.policies.items()
    policy_b = b.policies[key]
    a.generate("Repeat: one two three one two three one two three", max_new_tokens=16)
    own_a = _counts(policy_a)
    sync_a.sync()
    sync_b.sync()
    before = _counts(policy_b)
    b.generate("Count: 1 2 3 1 2 3 1 2 3", max_new_tokens=16)
    own_b = _minus(_counts(policy_b), before)
    sync_b.sync()
    sync_a.sync()
    assert _counts(policy_a) == _counts(policy_b) == _plus(own_a, own_b)

    hubs.append(PolicyHub())  # the hub restarted: empty
    before = _counts(policy_a)
    a.generate("Spell: a b c a b c a b c", max_new_tokens=8)
    more_a = _minus(_counts(policy_a), before)
    for sync in (sync_a, sync_b, sync_a, sync_b):
        sync.sync()
    total = hubs[-1].totals[key]
    assert (total["pulls"], total["rounds"]) == _plus(own_a, own_b, more_a)
    assert _counts(policy_a) == _counts(policy_b) == _plus(own_a, own_b, more_a)
    assert sync_a.epoch == sync_b.epoch == hubs[-1].epoch != hubs[0].epoch


def test_an_unresponsive_hub_costs_a_request_the_sync_timeout_at_most(local_ray) -> None:
    from metasd.serving.ray_replicas import PolicySync, remote_merge

    @ray.remote(num_cpus=0)
    class StuckHub:
        def merge(self, replica, pushed):
            time.sleep(60)

    hub = StuckHub.remote()
    a = _ucb()
    a.generate("Repeat: one two three one two three", max_new_tokens=8)
    ((key, policy),) = a.policies.items()
    learned = policy.state()
    sync = PolicySync(a, remote_merge(hub, timeout_s=0.5), 0.0)
    start = time.monotonic()
    sync.maybe_sync()  # logs the timeout and serves on
    assert time.monotonic() - start < 5
    assert sync.syncs == 0 and policy.state() == learned and a.policies[key] is policy
    ray.kill(hub)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replicas_answer_the_openai_client(local_ray) -> None:
    import httpx
    import openai
    from ray import serve

    from metasd.engine import Decoder
    from metasd.serving.ray_replicas import HUB_NAME, build

    port = _free_port()
    options = {"drafters": "ngram,suffix", "policy": "metasd-ucb", "policy_scope": "server"}
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(
            build(options, {"max_queue": 8}, replicas=2, replica_cpus=1, sync_s=0.0), name="metasd", route_prefix="/"
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name three colours."}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        chunks = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = Decoder(drafters="ngram,suffix", policy="metasd-ucb").generate(messages, max_new_tokens=16).text
        assert whole.choices[0].message.content == streamed == expected

        prompts = [f"Write the numbers from {i} to {i + 5}." for i in range(6)]  # concurrent: both replicas serve
        with ThreadPoolExecutor(6) as pool:
            texts = list(
                pool.map(
                    lambda p: (
                        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
                    ),
                    prompts,
                )
            )
        assert all(texts)
        with pytest.raises(openai.NotFoundError):  # the same errors as the one-process server
            client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert "metasd:generation_tokens" in metrics
        snapshot = ray.get(ray.get_actor(HUB_NAME).snapshot.remote())
        ((_, total),) = snapshot["totals"].items()
        assert snapshot["merges"] >= 3 and sum(total["pulls"]) > 0
        replicas = serve.status().applications["metasd"].deployments["metasd"].replica_states
        assert replicas.get("RUNNING") == 2
    finally:
        serve.shutdown()
        time.sleep(1)
