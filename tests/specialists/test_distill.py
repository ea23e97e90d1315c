"""`metasd distill` on a tiny budget: the saved drafter loads as lm:DIR, drafts, decodes losslessly, and resumes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import greedy_reference

from metasd.specialists.distill import distill
from metasd.specialists.prompts import chat_turn, prompt_messages, read_prompts


def test_prompt_formats(tmp_path):
    assert prompt_messages({"prompt": "Hi"}) == [{"role": "user", "content": "Hi"}]
    assert prompt_messages({"turns": ["First", "Second"]}) == [{"role": "user", "content": "First"}]
    turns = [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}, {"from": "human", "value": "More?"}]
    # a chat request (the user speaks last): the conversation so far, the earlier answer as context
    assert prompt_messages({"messages": turns}) == [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": "More?"},
    ]
    # a recorded conversation (ShareGPT's, however it ends; messages ending with an answer): its opening request
    assert prompt_messages({"conversations": turns}) == [{"role": "user", "content": "Q?"}]
    answered = {"messages": [*turns, {"from": "gpt", "value": "B."}]}
    assert prompt_messages(answered) == [{"role": "user", "content": "Q?"}]
    assert prompt_messages({"messages": [{"role": "assistant", "content": "x"}]}) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompts(bad)


def test_every_reader_of_chats_names_a_speaker_alike():
    """Prompts, datastores and EAGLE texts read a turn through `chat_turn`: the system and the answering model by
    their names, anyone else (`human`, no speaker named) as the user."""
    turns = [{"from": "human", "value": "a"}, {"from": "bard", "value": "b"}, {"role": "System", "content": "c"}, {}]
    assert [chat_turn(t) for t in turns] == [("user", "a"), ("assistant", "b"), ("system", "c"), ("user", None)]
    chat = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Q?"}]}
    assert prompt_messages(chat) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]


def test_tiny_distillation_loads_as_lm_and_stays_lossless(embedded, tmp_path):
    from metasd import Decoder
    from metasd.drafters import build_drafter

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": q}) for q in ("Name a color.", "What is 2 + 2?", "Say hello.", "Name a fruit."))
        + "\n"
    )
    out = tmp_path / "drafter"
    report = distill(
        None,
        str(prompts),
        out,
        layers=2,
        steps=2,
        batch_tokens=128,
        max_new_tokens=8,
        holdout=0.25,
        save_every=1,
        progress=False,
    )
    assert report["steps"] == 2 and report["train_answers"] == 3 and report["heldout_answers"] == 1
    assert report["acceptance_after"]["mean_accepted_tokens"] >= 1.0
    answers = (out / "distill-data" / "outputs.jsonl").read_text().splitlines()
    assert len(answers) == 4
    assert (out / "checkpoint.pt").is_file() and (out / "config.json").is_file()

    # resume: two more steps from the checkpoint, the cached answers are not regenerated
    again = distill(
        None,
        str(prompts),
        out,
        layers=2,
        steps=4,
        batch_tokens=128,
        max_new_tokens=8,
        holdout=0.25,
        save_every=1,
        progress=False,
    )
    assert again["steps"] == 4 and again["seconds"]["generate"] < 5
    assert (out / "distill-data" / "outputs.jsonl").read_text().splitlines() == answers
    # a rerun with nothing left to train only evaluates, and still reports the training's loss and time
    evaluated = distill(
        None, str(prompts), out, layers=2, steps=4, batch_tokens=128, max_new_tokens=8, holdout=0.25, progress=False
    )
    assert evaluated["seconds"]["train_this_run"] < 1 and evaluated["final_loss"] == again["final_loss"] is not None
    assert evaluated["seconds"]["train_all_runs"] == again["seconds"]["train_all_runs"] > 0
    with pytest.raises(ValueError, match="layers"):
        distill(None, str(prompts), out, layers=3, steps=5, max_new_tokens=8, progress=False)

    drafter = build_drafter(f"lm:{out}", embedded)  # the tokenizer check passes: same vocabulary
    assert len(drafter.lm.model.model.layers) == 2
    assert torch.equal(
        drafter.lm.model.get_input_embeddings().weight, embedded.model.get_input_embeddings().weight
    )  # frozen, shared with the target
    decoder = Decoder(drafters=[drafter], policy=f"fixed:lm:{out}", draft_len=3)
    ids = decoder.encode("Name a color.")
    reference = greedy_reference(embedded.model, ids, 12)
    result = decoder.generate(ids, max_new_tokens=12)
    assert result.token_ids == reference
    assert result.stats.to_dict()["drafters"][f"lm:{out}"]["drafted"] > 0


def test_second_turns_are_written_as_chat_requests_and_read_whole(tmp_path):
    """scripts/later_turn_prompts.py: each conversation's second request with the exchange before it, read back as
    a chat request of three turns; a conversation without one, a short request or a malformed record is left out."""
    ask = "Now say the same thing in French, please."
    records = [
        {"conversations": [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello!"}]},
        {
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hey"},
                {"from": "human", "value": "ok"},
            ]
        },
        {"conversations": {"from": "human"}},
        {
            "conversations": [
                {"from": "human", "value": "Say hello."},
                {"from": "gpt", "value": "Hello!"},
                {"from": "human", "value": ask},
                {"from": "gpt", "value": "Bonjour !"},
            ]
        },
    ]
    source, out = tmp_path / "chat.jsonl", tmp_path / "second.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n", encoding="utf-8")
    script = Path(__file__).resolve().parents[2] / "scripts" / "later_turn_prompts.py"
    subprocess.run([sys.executable, str(script), str(source), str(out)], check=True, capture_output=True)
    assert read_prompts(out) == [
        [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": ask},
        ]
    ]
