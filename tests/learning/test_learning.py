"""Heads that learn from the traffic they draft for: lossless whatever head drafts (a swap forced every round,
alone and in a batch), a worse head never swapped in, a better one swapped in and drafting better, bounded
buffers, history keys kept apart, saved heads resumed, and a trainer that fails or stops without touching
serving."""

import threading

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import decode_in_batch, greedy_reference

from metasd import Decoder
from metasd.batching.batch import Batch
from metasd.learning import HeadLearner, LearningConfig, TrafficBuffer
from metasd.learning.learner import expected_tokens
from metasd.models.eagle_head import EagleHead, TargetCheck, head_config_for, save_head
from metasd.serving.app import create_app

PROMPTS = ["Write a haiku about rivers.", "List three prime numbers.", "Name two rivers in Europe."]
SMALL = LearningConfig(train_every=1, steps=40, lr=1e-3, batch_tokens=1024, share=1.0)


@pytest.fixture(scope="module")
def head_dir(embedded, tmp_path_factory):
    """An untrained head for the embedded model over its 8192 lowest ids (it drafts, mostly wrongly)."""
    path = tmp_path_factory.mktemp("head")
    torch.manual_seed(0)
    save_head(
        path,
        EagleHead(head_config_for(embedded.model, 8192), torch.arange(8192)),
        "test",
        TargetCheck.of(embedded.model),
        {},
    )
    return str(path)


class EveryRound:
    """A learner that serves a different random head at every draft (and keeps what it is given)."""

    def __init__(self, model):
        self.model, self.version, self.collected = model, 0, []

    def current(self, key):
        self.version += 1
        torch.manual_seed(self.version)
        return self.version, EagleHead(head_config_for(self.model, 8192), torch.arange(8192))

    def collect(self, key, tokens, features, prompt):
        self.collected.append((key, tokens, features, prompt))


def test_greedy_output_is_the_targets_while_the_head_changes_every_round(embedded, head_dir):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}", draft_len=3)
    learner = EveryRound(embedded.model)
    decoder.drafters[spec].learn_from(learner)
    ids = decoder.encode(PROMPTS[0])
    result = decoder.generate(ids, max_new_tokens=24)
    assert result.token_ids == greedy_reference(embedded.model, ids, 24)
    assert learner.version >= 4  # a new head for each of several rounds
    ((key, tokens, features, prompt),) = learner.collected
    assert key == "" and prompt == len(ids) and tokens.tolist() == (ids + result.token_ids)[: len(tokens)]
    assert features.shape == (len(tokens), embedded.model.config.hidden_size) and len(tokens) >= len(ids) + 20

    requests = decode_in_batch(decoder, PROMPTS, 16, policy=f"fixed:{spec}")  # in a batch: a new head every round
    for request, prompt in zip(requests, PROMPTS, strict=True):
        assert request.token_ids == greedy_reference(embedded.model, decoder.encode(prompt), 16)


class ByHand:
    """A learner whose head in service is swapped by hand (`version`); it keeps nothing."""

    def __init__(self, head):
        self.version, self.head = 0, head

    def current(self, key):
        return (self.version, self.head) if self.version else (0, None)

    def collect(self, key, tokens, features, prompt):
        pass


def test_the_default_policy_forgets_what_it_carried_of_a_head_once_another_is_swapped_in(embedded, head_dir):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec, "ngram"])  # metasd-adaptive carries acceptance across requests
    torch.manual_seed(1)
    learner = ByHand(EagleHead(head_config_for(embedded.model, 8192), torch.arange(8192)))
    decoder.drafters[spec].learn_from(learner)
    ids = decoder.encode(PROMPTS[2])
    first = decoder.generate(ids, max_new_tokens=8)
    (policy,) = decoder.policies.values()
    assert policy.revisions == (0, None)
    history = policy.acceptance.history_tried
    history[:] = 1000.0  # a long record of the head as loaded, and of the n-gram drafter
    rows = list(policy.tables.rows_of(0))
    assert decoder.generate(ids, max_new_tokens=8).token_ids == first.token_ids
    assert policy.acceptance.history_tried[rows].min() >= 1000.0  # the same head: its record stays
    learner.version = 1
    assert decoder.generate(ids, max_new_tokens=8).token_ids == first.token_ids
    assert policy.revisions == (("", 1), None)
    assert policy.acceptance.history_tried[rows].max() < 1000.0  # only the swapped-in head's own rounds
    other = list(policy.tables.rows_of(1))
    assert policy.acceptance.history_tried[other].min() >= 1000.0


def _fill(decoder, spec, times=6, prompt=PROMPTS[1], tokens=32):
    ids = decoder.encode(prompt)
    return [decoder.generate(ids, max_new_tokens=tokens, policy=f"fixed:{spec}") for _ in range(times)]


def test_a_head_learns_its_traffic_and_is_swapped_in_only_when_it_measures_better(embedded, head_dir, tmp_path):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}", draft_len=4)
    learner = HeadLearner(decoder.drafters[spec], decoder.target, SMALL, tmp_path)
    decoder.drafters[spec].learn_from(learner)
    before = _fill(decoder, spec)
    rate_before = before[-1].stats.drafters()[spec].accepted / before[-1].stats.drafters()[spec].drafted

    class Worse(HeadLearner):  # rigged: training ruins the copy
        def _fine_tune(self, head, seqs):
            with torch.no_grad():
                for p in head.parameters():
                    p.copy_(torch.randn_like(p) * 3)
            return 1

    worse = Worse(decoder.drafters[spec], decoder.target, SMALL)
    worse.keys = learner.keys  # the same traffic
    record = worse.learn_now()
    assert not record["swapped"] and expected_tokens(record["candidate"]) <= expected_tokens(record["serving"])
    assert learner.current("") == (0, None)

    record = learner.learn_now()  # real fine-tuning on the same text: the held-out request is like the rest
    assert record["swapped"] and expected_tokens(record["candidate"]) > expected_tokens(record["serving"])
    version, head = learner.current("")
    assert version == 1 and head is not None
    after = _fill(decoder, spec, times=1)[0]
    assert after.token_ids == before[-1].token_ids
    rate_after = after.stats.drafters()[spec].accepted / after.stats.drafters()[spec].drafted
    assert rate_after > rate_before
    assert decoder.drafters[spec].version == ("", 1)

    resumed = HeadLearner(decoder.drafters[spec], decoder.target, SMALL, tmp_path)  # a restart
    version, again = resumed.current("")
    assert version == 1
    for a, b in zip(head.state_dict().values(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(a.half().float() if a.is_floating_point() else a, b.to(a.dtype))  # float16
    assert (tmp_path / "shared" / "learning.jsonl").read_text().count("\n") == 1
    assert learner.stats()["keys"]["shared"]["version"] == 1

    saved = tmp_path / "shared"
    assert (saved / "current").read_text().strip() == "head-v1" and (saved / "head-v1" / "config.json").is_file()
    (saved / "head-v2").mkdir()  # the process died while writing the next version: `current` still names v1
    (saved / "head-v2" / "config.json").write_text("{")
    assert HeadLearner(decoder.drafters[spec], decoder.target, SMALL, tmp_path).current("")[0] == 1
    (saved / "head-v1" / "head.safetensors").write_bytes(b"cut short")  # the disk lost it
    restarted = HeadLearner(decoder.drafters[spec], decoder.target, SMALL, tmp_path)  # serving starts all the same
    assert restarted.current("") == (0, None)


def test_a_learned_head_resumes_only_for_the_head_it_grew_from(embedded, head_dir, tmp_path):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec, "eagle"], policy=f"fixed:{spec}", draft_len=4)
    learner = HeadLearner(decoder.drafters[spec], decoder.target, SMALL, tmp_path)
    decoder.drafters[spec].learn_from(learner)
    _fill(decoder, spec, times=4)
    assert learner.learn_now()["swapped"]
    assert HeadLearner(decoder.drafters[spec], decoder.target, SMALL, tmp_path).current("")[0] == 1
    other = HeadLearner(decoder.drafters["eagle"], decoder.target, SMALL, tmp_path)  # the shipped head's learner
    assert other.current("") == (0, None)  # the directory's head grew from another head: not resumed


def test_the_buffer_never_exceeds_its_cap():
    buffer = TrafficBuffer(100)
    for n in (30, 50, 40, 10, 250):
        buffer.add(torch.arange(n), torch.ones(n, 4), prompt=5)
        assert buffer.tokens == sum(len(s.tokens) for s in buffer.sequences) <= 100
    assert len(buffer.sequences) == 1 and buffer.sequences[0].tokens[0] == 150  # the last 100 of 250 tokens
    assert buffer.sequences[0].prompt == 0 and buffer.added == 230  # tokens kept when added
    for n in (30, 30, 30):
        buffer.add(torch.arange(n), torch.ones(n, 4), prompt=5)
    held, train, mark = buffer.split(0.25)
    assert len(held) == 1 and len(train) == 2 and held[0] is buffer.sequences[-1]
    window = TrafficBuffer(100, longest=40)  # training's window: a long request keeps its end, where its answer is
    window.add(torch.arange(60), torch.ones(60, 4), prompt=50)
    assert window.sequences[0].tokens.tolist() == list(range(20, 60)) and window.sequences[0].prompt == 30


def test_held_out_sequences_were_never_trained_on_by_the_head_in_service():
    buffer = TrafficBuffer(1000)

    def add(*lengths):
        for n in lengths:
            buffer.add(torch.full((n,), n), torch.ones(n, 4), prompt=2)

    add(40, 41, 42, 43)
    held, train, mark = buffer.split(0.5)
    assert [len(s.tokens) for s in held] == [42, 43] and [len(s.tokens) for s in train] == [40, 41]
    assert [len(s.tokens) for s in buffer.split(0.5)[0]] == [42, 43]  # no swap yet: still unseen by the head in service
    buffer.mark_trained(mark)  # a head trained on 40 and 41 is in service
    add(44)  # one new sequence: a share of 0.5 would reach back into the trained ones
    held, train, mark = buffer.split(0.5)
    assert [len(s.tokens) for s in held] == [42, 43, 44] and [len(s.tokens) for s in train] == [40, 41]
    buffer.mark_trained(mark)
    buffer.mark_trained(1)  # an older mark never moves it back
    add(45)
    held, train, mark = buffer.split(0.9)  # a share past the fresh sequences: only they are held out
    assert [len(s.tokens) for s in held] == [42, 43, 44, 45] and [len(s.tokens) for s in train] == [40, 41]
    held, train, mark = buffer.split(0.2)
    assert [len(s.tokens) for s in held] == [44, 45] and len(train) == 4
    buffer.mark_trained(mark)
    assert [len(s.tokens) for s in buffer.split(0.9)[0]] == [44, 45]
    for _ in range(5):
        buffer.drop_oldest()  # dropped: the count stays in step
    assert buffer.split(0.5)[:2] == ([], [])  # one sequence left: nothing to train on


def test_every_keys_buffers_together_keep_to_the_total_cap(embedded, head_dir):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}", draft_len=3)
    learner = HeadLearner(decoder.drafters[spec], decoder.target, LearningConfig(buffer_tokens=100, total_tokens=150))
    for i in range(12):
        n = 20 + i
        learner.collect(f"key-{i % 4}", torch.full((n,), n), torch.ones(n, 4), prompt=2)
        held = {k: s.buffer.tokens for k, s in learner.keys.items()}
        assert sum(held.values()) <= 150 and max(held.values()) <= 100
    assert [learner.keys[f"key-{k}"].buffer.sequences[-1].tokens[0] for k in range(4)] == [28, 29, 30, 31]
    with pytest.raises(ValueError, match="total cap"):
        LearningConfig(total_tokens=1)


def test_history_off_collects_nothing_and_keys_never_cross(embedded, head_dir):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}", draft_len=3)
    drafter = decoder.drafters[spec]
    learner = HeadLearner(drafter, decoder.target, SMALL)
    drafter.learn_from(learner)
    ids = decoder.encode(PROMPTS[2])
    drafter.use_history(None)
    decoder.generate(ids, max_new_tokens=8)
    assert not learner.keys
    drafter.use_history("key-0")
    for _ in range(3):
        decoder.generate(ids, max_new_tokens=16)
    assert set(learner.keys) == {"key-0"} and len(learner.keys["key-0"].buffer.sequences) == 3
    learner.keys["key-0"].head, learner.keys["key-0"].version = EveryRound(embedded.model).current("key-0")[1], 1
    drafter.use_history("key-1")
    out = decoder.generate(ids, max_new_tokens=8)
    assert drafter.version == ("key-1", 0) and drafter.exact_head is drafter._base[1]  # the head as loaded
    assert out.token_ids == greedy_reference(embedded.model, ids, 8)
    drafter.use_history("key-0")
    decoder.generate(ids, max_new_tokens=8)
    assert drafter.version == ("key-0", 1)
    assert learner.report("key-1")["version"] == 0 and learner.report(None) is None


def test_a_failing_trainer_leaves_serving_running_and_stops_with_the_server(embedded, head_dir, monkeypatch):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec, "ngram"], policy="metasd-adaptive")
    calls = threading.Event()

    def broken(self, head, seqs):
        calls.set()
        raise RuntimeError("rigged")

    monkeypatch.setattr(HeadLearner, "_fine_tune", broken)
    app = create_app(decoder, max_batch=2, learning=LearningConfig(train_every=1, share=1.0))
    (learner,) = app.state.learners
    with TestClient(app) as client:
        for prompt in PROMPTS * 2:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
        assert calls.wait(30)
        for _ in range(100):
            if learner.failures:
                break
            threading.Event().wait(0.1)
        assert learner.failures >= 1 and "rigged" in learner.last_error
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200
        assert "metasd:learning_failures" in client.get("/metrics").text
        body = client.get("/v1/learning").json()["data"][0]
        assert body["drafter"] == spec and body["key"] == "shared" and body["version"] == 0
        thread = learner._thread
    assert thread is not None and not thread.is_alive()


def test_the_trainer_waits_for_a_gap_between_requests(embedded, head_dir):
    """By default the trainer trains only while its server decodes nothing (`busy`), so serving never shares the
    cores or the interpreter with it; it resumes in the next gap."""
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}", draft_len=3)
    learner = HeadLearner(decoder.drafters[spec], decoder.target, LearningConfig(train_every=1, steps=2, share=1.0))
    decoder.drafters[spec].learn_from(learner)
    _fill(decoder, spec, times=3, tokens=16)
    decoding = threading.Event()
    decoding.set()
    learner.busy = decoding.is_set
    learner.start()
    try:
        threading.Event().wait(2.0)
        assert not learner.keys[""].records and learner.busy_seconds == 0  # not a step while the server decodes
        decoding.clear()
        for _ in range(300):
            if learner.keys[""].records:
                break
            threading.Event().wait(0.1)
        assert learner.keys[""].records and learner.busy_seconds > 0
    finally:
        learner.close()
    assert not learner._thread.is_alive()


def test_the_trainers_thread_count_leaves_the_servers_alone(embedded, head_dir, monkeypatch):
    """The trainer runs one torch thread, and torch starts each thread from a process-wide default that setting it
    moves: the server's decoding thread keeps the count the process had when the server was made."""
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}", draft_len=2)
    seen = []
    original = Batch.step

    def step(batch):
        seen.append(torch.get_num_threads())
        return original(batch)

    monkeypatch.setattr(Batch, "step", step)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        app = create_app(decoder, max_batch=2, learning=LearningConfig(train_every=1, steps=1, share=1.0))
        (learner,) = app.state.learners
        with TestClient(app) as client:
            threading.Event().wait(0.5)  # the trainer thread has started and set its own count
            assert learner._thread.is_alive()
            r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {2}
