#!/usr/bin/env bash
# Trains a general EAGLE head for the Qwen pair's target (Qwen2.5-Coder-1.5B-Instruct, `--preset qwen-coder`):
# 1. prompts (ShareGPT first turns, stdlib docstrings, Django catalogs; never a benchmark set) under specialists/;
# 2. the target's own greedy answers in bfloat16 (the dtype it is benchmarked in) with its features
#    (eagle-data/qwen/, resumable), up to TOKENS tokens: a fixed shuffled order, so a budget is a fair sample;
#    then its features on ShareGPT conversations held apart from the prompts (one prefill each), TEXTS tokens;
# 3. training with the training-time test (--unroll 2: long drafts are what pay on a target whose verification
#    is flat), into specialists/eagle-qwen-coder/ (about 100 MB in float16: not shipped with the package).
# Use: metasd bench --preset qwen-coder --drafters eagle:specialists/eagle-qwen-coder,ngram,suffix,lm:DRAFTER ...
# Usage: bash scripts/train_qwen_head.sh   (from the repository root, in the project's venv; needs the pair from
# scripts/qwen_coder_pair.sh or the hub; TOKENS=40000 TEXTS=40000 EPOCHS=4)
set -euo pipefail
tokens=${TOKENS:-40000}
texts=${TEXTS:-40000}
epochs=${EPOCHS:-4}
target=${TARGET:-$HOME/.cache/metasd-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
[ -f specialists/prompts/chat.jsonl ] && [ -f specialists/prompts/code.jsonl ] && [ -f specialists/corpora/chat.jsonl ] ||
    python scripts/build_specialists.py --out specialists --domains chat,code --prompts 2500 --prompts-only
[ -f specialists/prompts/translation.jsonl ] ||
    python scripts/build_specialists.py --out specialists --domains translation --prompts 600 --prompts-only
metasd train-eagle --target "$target" --dtype bfloat16 --prompts specialists/prompts/chat.jsonl \
    specialists/prompts/code.jsonl specialists/prompts/translation.jsonl --corpus eagle-data/qwen \
    --corpus-tokens "$tokens" --gen-batch 24 --max-new-tokens 192 --texts specialists/corpora/chat.jsonl \
    --texts-corpus eagle-data/qwen-texts --texts-tokens "$texts" --epochs "$epochs" --unroll 2 \
    --batch-tokens 2048 --out specialists/eagle-qwen-coder
