#!/usr/bin/env bash
# Trains a general EAGLE head for the Qwen pair's target (Qwen2.5-Coder-1.5B-Instruct, `--preset qwen-coder`), the
# way the embedded model's shipped head is trained (scripts/train_shipped_head.sh):
# 1. ShareGPT conversations held apart from any prompt set (specialists/corpora/chat.jsonl; never a benchmark set);
# 2. held out: the target's greedy answers (bfloat16, <= 192 tokens) to the everyday requests of the project's own
#    writing (experiments/data/everyday_requests.jsonl) with its features of layers 1 and 13 (`--feature-layers
#    auto` for its 28 layers), in eagle-data/qwen-everyday/;
# 3. training streamed: the target (bfloat16) prefills each batch's conversations for its features and next-token
#    distributions, the head (bfloat16 autocast) learns them with the training-time test over 3 draft tokens, up to
#    TOKENS positions in steps of 2,048 (a new head on a short budget: more optimiser steps for the same
#    positions), over a draft vocabulary of 16,384 tokens of 151,646 (what each size holds of the target's
#    answers: docs/results/2026-12-06-qwen-head-streamed.md; the readout grows from a fifth of the head's step to
#    a third); held-out metrics every 50 steps; resumable (checkpoint.pt); the head in
#    specialists/eagle-qwen-coder/ (about 100 MB in float16: not shipped with the package).
# Use: metasd bench --preset qwen-coder --drafters eagle:specialists/eagle-qwen-coder,ngram,suffix,lm:DRAFTER ...
# Usage: bash scripts/train_qwen_head.sh   (from the repository root, in the project's venv; needs the pair from
# scripts/qwen_coder_pair.sh or TARGET=...; TOKENS=380000)
set -euo pipefail
export TARGET=${TARGET:-$HOME/.cache/metasd-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
tokens=${TOKENS:-380000}
[ -f specialists/corpora/chat.jsonl ] ||
    python scripts/build_specialists.py --out specialists --domains chat,code --prompts 2500 --prompts-only
python - <<'PY'
import os
from pathlib import Path
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import encode_prompts, read_prompt_files, write_corpus
target = load_model(os.environ["TARGET"], "bfloat16")  # the corpus resumes from its shards (a finished one is read)
prompts = encode_prompts(target.tokenizer, read_prompt_files(["experiments/data/everyday_requests.jsonl"]), 384)
out = Path("eagle-data/qwen-everyday")
write_corpus(target, prompts, out, max_new_tokens=192, batch_size=20, feature_layers=(1, 13))
PY
metasd train-eagle --target "$TARGET" --dtype bfloat16 --stream --texts specialists/corpora/chat.jsonl \
    --texts-tokens "$tokens" --max-text-tokens 1024 --held-out eagle-data/qwen-everyday --epochs 1 --unroll 3 \
    --feature-layers auto --draft-vocab 16384 --batch-tokens 2048 --autocast --evaluate-every 50 --threads 2 \
    --out specialists/eagle-qwen-coder
