#!/usr/bin/env bash
# Rebuilds the EAGLE head metasd ships for the embedded model (src/metasd/heads/smollm2-135m-instruct/).
# 1. prompts (ShareGPT first turns, stdlib docstrings, Django catalogs; never a benchmark set) under specialists/;
# 2. the target's own greedy answers with its features (eagle-data/general/, resumable), up to the token budget,
#    and its features on ShareGPT conversations held apart from the prompts (eagle-data/texts/, one prefill each);
# 3. training, then the head written into the package (checkpoint and corpus stay out of it).
# Usage: bash scripts/train_shipped_head.sh   (from the repository root, in the project's venv)
set -euo pipefail
python scripts/build_specialists.py --out specialists --domains chat,code --prompts 2500 --prompts-only
python scripts/build_specialists.py --out specialists --domains translation --prompts 600 --prompts-only
out=src/metasd/heads/smollm2-135m-instruct
metasd train-eagle --prompts specialists/prompts/chat.jsonl specialists/prompts/code.jsonl \
    specialists/prompts/translation.jsonl --corpus eagle-data/general --corpus-tokens 413290 \
    --gen-batch 48 --max-new-tokens 256 --texts specialists/corpora/chat.jsonl --texts-corpus eagle-data/texts \
    --texts-tokens 611561 --epochs 2 --out eagle-data/head
mkdir -p "$out" && cp eagle-data/head/config.json eagle-data/head/head.safetensors "$out/"
