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
    from metasd.bench import BenchConfig

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
    from metasd.bench import run_bench

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
    learned = dict(a._policies)
    ((key, policy_a),) = learned.items()
    assert sum(policy_a.state()["pulls"]) > 0
    sync_a.sync()
    sync_b.sync()  # b had never served this policy: it is created from the pooled statistics
    policy_b = b._policies[key]
    assert policy_b.state() == policy_a.state()
    b.generate("Count: 1 2 3 1 2 3 1 2 3", max_new_tokens=12)
    sync_b.sync()
    sync_a.sync()
    total = hub.totals[key]
    assert policy_a.state()["pulls"] == policy_b.state()["pulls"] == total["pulls"]
    assert policy_a.state()["rounds"] == total["rounds"]
    assert policy_a.mean_rewards == pytest.approx(policy_b.mean_rewards)


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
