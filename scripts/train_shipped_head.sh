#!/usr/bin/env bash
# Rebuilds the EAGLE head metasd ships for the embedded model (src/metasd/heads/smollm2-135m-instruct/).
# 1. ShareGPT conversations held apart from any prompt set (specialists/corpora/chat.jsonl; never a benchmark set);
# 2. training streamed: the target (bfloat16) prefills each batch's conversations for its features (layers 1 and 14
#    and the final norm) and next-token distributions, the head (bfloat16 autocast) learns them with the
#    training-time test over 3 draft tokens, in three phases; held-out metrics on the target's answers to everyday
#    requests of the project's own writing (experiments/data/everyday_requests.jsonl) every 50 steps; resumable
#    (checkpoint.pt);
# 3. then the target's own answers: it answers ShareGPT first turns (specialists/prompts/chat.jsonl, held apart from
#    the conversations) greedily in bfloat16, its features captured as it writes (eagle-data/chat-answers), and the
#    head learns them at a lower peak rate in two phases, the second on a corpus grown past the first's; a third
#    adds its answers to 2,500 more first turns, from the end of the conversations' file and none answered
#    before, and learns both corpora; a fourth its answers to the next 2,500 from the end and to stdlib code prompts
#    (specialists/prompts/code.jsonl), learnt with the third's;
# 4. the head written into the package (checkpoint and learning curve stay out of it).
# Usage: bash scripts/train_shipped_head.sh   (from the repository root, in the project's venv)
set -euo pipefail
python scripts/build_specialists.py --out specialists --domains chat,code --prompts 2500 --prompts-only
python - <<'PY'
from pathlib import Path
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import encode_prompts, read_prompt_files, write_corpus
target = load_model(None, "float32")  # the corpus resumes from the shards written (a finished one is only read)
prompts = encode_prompts(target.tokenizer, read_prompt_files(["experiments/data/everyday_requests.jsonl"]), 384)
write_corpus(target, prompts, Path("eagle-data/everyday"), max_new_tokens=256, batch_size=20, feature_layers=(1, 14))
PY
out=src/metasd/heads/smollm2-135m-instruct
common=(--dtype bfloat16 --stream --texts specialists/corpora/chat.jsonl --max-text-tokens 1024
    --held-out eagle-data/everyday --epochs 1 --unroll 3 --feature-layers auto --autocast --evaluate-every 50
    --threads 2)
# three phases (2.8 M, 2.8 M and 4.4 M positions), each from the last one's head, on the conversations after the
# last one's (each its own warm-up and cosine schedule)
metasd train-eagle "${common[@]}" --texts-tokens 2800000 --out eagle-data/head-stream-amx
metasd train-eagle "${common[@]}" --texts-tokens 2800000 --init eagle-data/head-stream-amx \
    --texts-skip-tokens 2800000 --out eagle-data/head-stream-amx-2
metasd train-eagle "${common[@]}" --texts-tokens 4400000 --init eagle-data/head-stream-amx-2 \
    --texts-skip-tokens 5600000 --out eagle-data/head-stream-amx-3
answers=(--max-new-tokens 256 --gen-batch 48 --dtype bfloat16 --feature-layers auto --unroll 3
    --held-out eagle-data/everyday --lr 3e-4 --autocast --evaluate-every 10 --threads 2)
chat=(--prompts specialists/prompts/chat.jsonl --corpus eagle-data/chat-answers)
metasd train-eagle "${answers[@]}" "${chat[@]}" --corpus-tokens 250000 --epochs 3 --init eagle-data/head-stream-amx-3 \
    --out eagle-data/head-answers
metasd train-eagle "${answers[@]}" "${chat[@]}" --corpus-tokens 500000 --epochs 2 --init eagle-data/head-answers \
    --out eagle-data/head-answers-2
python - <<'TAIL'
import json
from pathlib import Path
lines = [line for line in Path("specialists/corpora/chat.jsonl").read_text(encoding="utf-8").split("\n") if line]
used = {json.loads(line)["prompt"] for line in Path("specialists/prompts/chat.jsonl").read_text().splitlines()}
tail, tail_2 = [], []
for line in reversed(lines):  # first turns from the file's end, none of those answered above
    turns = json.loads(line)["conversations"]
    first = turns[0].get("value", "") if turns and turns[0].get("from") == "human" else ""
    if 20 <= len(first) <= 2000 and first not in used:
        if len(tail) < 2500:
            tail.append(first)
        elif first not in tail and first not in tail_2 and len(tail_2) < 2500:
            tail_2.append(first)  # the fourth phase's: the next ones, none seen before
Path("eagle-data/prompts").mkdir(parents=True, exist_ok=True)
for name, prompts in (("chat-tail", tail), ("chat-tail-2", tail_2)):
    Path(f"eagle-data/prompts/{name}.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")
TAIL
metasd train-eagle "${answers[@]}" --prompts eagle-data/prompts/chat-tail.jsonl \
    --corpus eagle-data/chat-answers-tail eagle-data/chat-answers --corpus-tokens 600000 --epochs 2 \
    --init eagle-data/head-answers-2 --out eagle-data/head-answers-3
# the fourth: answers to the next first turns from the file's end and to the code prompts, interleaved, learnt with
# the third's
metasd train-eagle "${answers[@]}" --prompts eagle-data/prompts/chat-tail-2.jsonl specialists/prompts/code.jsonl \
    --corpus eagle-data/answers-code-chat eagle-data/chat-answers-tail --corpus-tokens 620000 --epochs 2 \
    --init eagle-data/head-answers-3 --out eagle-data/head-answers-4
mkdir -p "$out" && cp eagle-data/head-answers-4/config.json eagle-data/head-answers-4/head.safetensors "$out/"
