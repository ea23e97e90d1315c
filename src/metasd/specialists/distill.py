"""`metasd distill`: a small drafter trained on the target's own greedy outputs for a domain's prompts.

Self-distillation in two resumable stages, both under `--out DIR`:

1. **Data.** The target answers every prompt greedily (its chat template, `--max-new-tokens`), in batches; each
   answer is appended to `DIR/distill-data/outputs.jsonl` as it is made, so a rerun skips what is there.
2. **Training.** The drafter is the target cut to its first `--layers` decoder layers, plus the final norm, the
   embedding and the LM head (tied in SmolLM2 and Qwen2.5): the target's vocabulary and tokenizer by construction.
   The embedding and the head stay frozen (shared knowledge, and far fewer trainable weights); the layers and the norm
   learn to predict the target's greedy token at each position of its answers (cross-entropy on the answer tokens,
   i.e. sequence-level distillation). Greedy acceptance depends only on the argmax, which this loss trains
   directly. A checkpoint (`DIR/checkpoint.pt`) is written every `--save-every` steps; a rerun resumes from it.

At the end DIR holds a `save_pretrained` model and the tokenizer, so `lm:DIR` loads it, and `distill.json` with the
run's numbers: the held-out prompts' mean accepted tokens per round at k = `--draft-len` (greedy), before training
(the plain early exit) and after. That measure is exact for greedy decoding and needs one forward pass per answer:
a round from position i accepts the run of consecutive positions where the drafter's argmax, given the true prefix,
equals the target's token (at most k), then the target adds one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from pathlib import Path

import torch

PROMPT_FIELDS = ("prompt", "question", "instruction", "input", "text")


def prompt_messages(record) -> list[dict] | None:
    """A JSONL record's prompt as chat messages: a string field, Spec-Bench-like `turns`, or a chat's first turns."""
    if isinstance(record, str):
        return [{"role": "user", "content": record}] if record.strip() else None
    if not isinstance(record, dict):
        return None
    for field in ("messages", "conversations"):
        turns = record.get(field)
        if isinstance(turns, list):
            messages = []
            for turn in turns:
                if not isinstance(turn, dict):
                    return None
                role = str(turn.get("role", turn.get("from", "user"))).lower()
                content = turn.get("content", turn.get("value"))
                if role in ("assistant", "gpt", "model", "chatgpt", "bing", "bard"):
                    break  # the target writes the answer itself
                if not isinstance(content, str):
                    return None
                messages.append({"role": "system" if role == "system" else "user", "content": content})
            return messages if any(m["role"] == "user" and m["content"].strip() for m in messages) else None
    if isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
        return [{"role": "user", "content": record["turns"][0]}]
    for field in PROMPT_FIELDS:
        if isinstance(record.get(field), str) and record[field].strip():
            return [{"role": "user", "content": record[field]}]
    return None


def read_prompts(path: str | Path) -> list[list[dict]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"cannot read --prompts: {err}") from err
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = prompt_messages(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from err
        if messages is None:
            raise ValueError(f'{path}:{number}: no prompt (expected "prompt", "turns", "messages", ... )')
        prompts.append(messages)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def encode(tokenizer, messages: list[dict]) -> list[int]:
    """As Decoder.encode: the chat template with the generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


@torch.inference_mode()
def generate_outputs(
    target,
    prompts: list[list[dict]],
    cache: Path,
    max_new_tokens: int,
    max_prompt_tokens: int,
    batch_size: int,
    progress: bool = True,
) -> list[dict]:
    """The target's greedy answers, cached in `cache` (JSONL: index, prompt_ids, output_ids); resumable."""
    from tqdm import tqdm

    done: dict[int, dict] = {}
    if cache.is_file():
        for line in cache.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                done[int(row["index"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut short by an interrupted run: redone below
    tok, model = target.tokenizer, target.model
    eos = set(target.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos) if eos else 0)
    todo = []
    for i, messages in enumerate(prompts):
        if i in done:
            continue
        ids = encode(tok, messages)
        if len(ids) > max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]  # keep the end, where the question and the generation prompt are
        todo.append((i, ids))
    todo.sort(key=lambda item: len(item[1]))  # similar lengths batch with little padding
    cache.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(cache, "a", encoding="utf-8") as f,
        tqdm(total=len(prompts), initial=len(done), unit="prompt", desc="target answers", disable=not progress) as bar,
    ):
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
            for (i, ids), row in zip(batch, out[:, width:].tolist(), strict=True):
                cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))  # keep the EOS: learn to stop
                record = {"index": i, "prompt_ids": ids, "output_ids": row[:cut]}
                done[i] = record
                f.write(json.dumps(record) + "\n")
            f.flush()
            bar.update(len(batch))
    return [done[i] for i in sorted(done)]


def make_drafter(target_model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The target's first `layers` decoder layers, final norm, embedding and head, as a standalone causal LM."""
    from transformers import AutoModelForCausalLM

    from ..drafters.early_exit import truncated_config

    config = truncated_config(target_model.config, layers, "--layers must be")
    for attr in ("gguf_file", "_name_or_path"):
        if hasattr(config, attr):
            setattr(config, attr, "" if attr == "_name_or_path" else None)
    drafter = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for key, value in target_model.state_dict().items():
        if ".layers." in key:
            index = int(key.split(".layers.")[1].split(".")[0])
            if index >= layers:
                continue
        state[key] = value.detach().to(torch.float32).clone()
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"cannot cut the target into a drafter: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        drafter.tie_weights()
    drafter.generation_config = copy.deepcopy(target_model.generation_config)
    return drafter


def trainable_parameters(drafter: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Everything but the embedding and the LM head."""
    frozen = {id(drafter.get_input_embeddings().weight), id(drafter.get_output_embeddings().weight)}
    out = {}
    for name, param in drafter.named_parameters():
        param.requires_grad_(id(param) not in frozen)
        if param.requires_grad:
            out[name] = param
    return out


def _examples(rows: list[dict], max_len: int) -> list[tuple[list[int], int]]:
    """(tokens, index of the first answer token) per row, keeping the end of over-long prompts."""
    out = []
    for row in rows:
        prompt, answer = row["prompt_ids"], row["output_ids"]
        if not answer:
            continue
        answer = answer[: max_len - 1]
        prompt = prompt[-(max_len - len(answer)) :]
        out.append((prompt + answer, len(prompt)))
    return out


def _batches(examples: list[tuple[list[int], int]], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that a batch pads little and holds about batch_tokens (padded) tokens."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches, current, width = [], [], 0
    for i in order:
        n = len(examples[i][0])
        if current and max(width, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, n)
    if current:
        batches.append(current)
    return batches


def _tensors(examples, indices, pad: int):
    seqs = [examples[i] for i in indices]
    width = max(len(s) for s, _ in seqs) - 1
    inputs = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, (tokens, answer_start) in enumerate(seqs):
        n = len(tokens) - 1
        inputs[row, :n] = torch.tensor(tokens[:-1])
        mask[row, :n] = 1
        labels[row, answer_start - 1 : n] = torch.tensor(tokens[answer_start:])  # predict each answer token
    return inputs, mask, labels


def _answer_logits(drafter, inputs, mask, labels):
    """Head logits only where there is a label: the 49k-wide head dominates the cost, prompts need none."""
    hidden = drafter.base_model(input_ids=inputs, attention_mask=mask).last_hidden_state
    keep = labels != -100
    return drafter.get_output_embeddings()(hidden[keep]), labels[keep]


@torch.inference_mode()
def acceptance(drafter, examples, k: int, pad: int, batch_tokens: int = 4096) -> dict:
    """Greedy mean accepted tokens per round (target token included) and argmax agreement on held-out answers."""
    drafter.eval()
    rounds = tokens = agree = total = 0
    for indices in _batches(examples, batch_tokens):
        inputs, mask, labels = _tensors(examples, indices, pad)
        hidden = drafter.base_model(input_ids=inputs, attention_mask=mask).last_hidden_state
        for row in range(len(indices)):
            keep = labels[row] != -100
            hits = (drafter.get_output_embeddings()(hidden[row][keep]).argmax(-1) == labels[row][keep]).tolist()
            agree += sum(hits)
            total += len(hits)
            i = 0
            while i < len(hits):  # each round: the run of agreeing drafts (<= k), then the target's own token
                run = 0
                while run < k and i + run < len(hits) and hits[i + run]:
                    run += 1
                step = min(run + 1, len(hits) - i)
                tokens += step
                rounds += 1
                i += step
    return {
        "mean_accepted_tokens": round(tokens / max(rounds, 1), 4),
        "agreement": round(agree / max(total, 1), 4),
        "answers": len(examples),
        "answer_tokens": total,
    }


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def distill(
    target_spec: str | None,
    prompts_path: str,
    out: str | Path,
    layers: int = 4,
    steps: int = 300,
    batch_tokens: int = 2048,
    lr: float = 1e-3,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 512,
    max_len: int = 512,
    gen_batch: int = 8,
    holdout: float = 0.1,
    draft_len: int = 5,
    save_every: int = 25,
    seed: int = 0,
    restart: bool = False,
    progress: bool = True,
    eval_on: tuple[str, ...] = (),
    eval_answers: int = 100,
) -> dict:
    from tqdm import tqdm

    from ..models.loading import load_model

    out = Path(out)
    if steps < 0 or batch_tokens < 16 or lr <= 0 or max_new_tokens < 1 or not 0 <= holdout < 1:
        raise ValueError("distill: need steps >= 0, batch tokens >= 16, lr > 0, max new tokens >= 1, 0 <= holdout < 1")
    prompts = read_prompts(prompts_path)
    target = load_model(target_spec, device="cpu")  # the training loop below is written for the CPU
    started = time.perf_counter()
    ckpt_path = out / "checkpoint.pt"
    if restart and ckpt_path.exists():
        ckpt_path.unlink()
    rows = generate_outputs(
        target, prompts, out / "distill-data" / "outputs.jsonl", max_new_tokens, max_prompt_tokens, gen_batch, progress
    )
    generate_s = time.perf_counter() - started
    rng = random.Random(seed)
    shuffled = rows[:]
    rng.shuffle(shuffled)
    n_held = int(round(len(rows) * holdout)) if len(rows) > 1 else 0
    held, train = _examples(shuffled[:n_held], max_len), _examples(shuffled[n_held:], max_len)
    if not train:
        raise ValueError("distill: no training answers (every answer was empty?)")
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    torch.manual_seed(seed)
    drafter = make_drafter(target.model, layers)
    params = trainable_parameters(drafter)
    optimizer = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    step, meta = 0, {}
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ckpt.get("layers") != layers:
            raise ValueError(
                f"{ckpt_path} is a {ckpt.get('layers')}-layer run; use --layers {ckpt.get('layers')} or --restart"
            )
        drafter.load_state_dict(ckpt["trainable"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        step, meta = int(ckpt["step"]), ckpt.get("meta", {})
    if "before" not in meta and held:
        meta["before"] = acceptance(drafter, held, draft_len, pad)
    batches = _batches(train, batch_tokens)
    train_started = time.perf_counter()
    trained_before = meta.get("train_seconds", 0.0)
    losses: list[float] = []

    def save_checkpoint() -> None:
        # the loss and training time travel with the checkpoint, so that a rerun that only evaluates (--eval-on on
        # a finished run) still reports them
        meta["final_loss"] = round(sum(losses[-20:]) / len(losses[-20:]), 4)
        meta["train_seconds"] = round(trained_before + time.perf_counter() - train_started, 1)
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "step": step,
                "layers": layers,
                "trainable": {n: p.detach() for n, p in params.items()},
                "optimizer": optimizer.state_dict(),
                "meta": meta,
            },
            tmp,
        )
        os.replace(tmp, ckpt_path)

    out.mkdir(parents=True, exist_ok=True)
    drafter.train()
    with tqdm(total=steps, initial=min(step, steps), unit="step", desc="training", disable=not progress) as bar:
        while step < steps:
            epoch, within = divmod(step, len(batches))
            order = list(range(len(batches)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)  # a function of the step: resumes identically
            inputs, mask, labels = _tensors(train, batches[order[within]], pad)
            for group in optimizer.param_groups:
                group["lr"] = _lr(step, steps, lr, warmup=max(1, min(20, steps // 10)))
            logits, target_ids = _answer_logits(drafter, inputs, mask, labels)
            loss = torch.nn.functional.cross_entropy(logits, target_ids)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
            optimizer.step()
            step += 1
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
            bar.update(1)
            if step % save_every == 0 or step == steps:
                save_checkpoint()
    train_s = time.perf_counter() - train_started
    if held:
        meta["after"] = acceptance(drafter, held, draft_len, pad)
    cross = {}
    for other in eval_on:  # another domain's cached target answers: how this specialist does off its domain
        path = Path(other) / "distill-data" / "outputs.jsonl"
        if not path.is_file():
            raise ValueError(f"--eval-on {other}: no {path} (run distill there first)")
        rows_other = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        random.Random(seed).shuffle(rows_other)
        cross[str(other)] = acceptance(drafter, _examples(rows_other[:eval_answers], max_len), draft_len, pad)
    drafter.eval()
    for p in drafter.parameters():
        p.requires_grad_(False)
    drafter.save_pretrained(out)
    tok.save_pretrained(out)
    report = {
        "target": target_spec or "embedded",
        "prompts": str(prompts_path),
        "layers": layers,
        "steps": step,
        "batch_tokens": batch_tokens,
        "lr": lr,
        "max_new_tokens": max_new_tokens,
        "train_answers": len(train),
        "train_answer_tokens": sum(len(s) - a for s, a in train),
        "heldout_answers": len(held),
        "draft_len": draft_len,
        "acceptance_before": meta.get("before"),
        "acceptance_after": meta.get("after"),
        "acceptance_elsewhere": cross,
        "final_loss": meta.get("final_loss"),
        "seconds": {
            "generate": round(generate_s, 1),
            "train_this_run": round(train_s, 1),
            "train_all_runs": meta.get("train_seconds"),
            "total_this_run": round(time.perf_counter() - started, 1),
        },
    }
    (out / "distill.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report
