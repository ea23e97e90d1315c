#!/usr/bin/env bash
# Trains the MetaEagle pool for the embedded model (the paper's Table 4): one EAGLE head per domain (code, chat, math,
# translation), each on the target's own answers to that domain's prompts only, and one head on their union (OFA).
# 1. prompts (ShareGPT first turns, stdlib docstrings, DeepMind's generated math problems, Django catalogs; never a
#    benchmark set) under specialists/prompts/;
# 2. per domain, the target's greedy answers with its features (eagle-data/DOMAIN/, resumable), TOKENS tokens each;
# 3. the heads, written to specialists/eagle-DOMAIN/ and specialists/eagle-mixed/, where `bench --preset
#    eagle-specialists` finds them.
# Usage: bash scripts/train_domain_heads.sh   (from the repository root, in the project's venv; TOKENS=100000)
set -euo pipefail
tokens=${TOKENS:-100000}
epochs=${EPOCHS:-3}
[ -f specialists/prompts/chat.jsonl ] && [ -f specialists/prompts/code.jsonl ] ||
    python scripts/build_specialists.py --out specialists --domains chat,code --prompts 2500 --prompts-only
[ -f specialists/prompts/translation.jsonl ] ||
    python scripts/build_specialists.py --out specialists --domains translation --prompts 600 --prompts-only
[ -f specialists/prompts/math.jsonl ] ||
    python scripts/build_specialists.py --out specialists --domains math --prompts 1000 --prompts-only
for domain in code chat math translation; do
    metasd train-eagle --prompts "specialists/prompts/$domain.jsonl" --corpus "eagle-data/$domain" \
        --corpus-tokens "$tokens" --gen-batch 48 --max-new-tokens 256 --epochs "$epochs" \
        --out "specialists/eagle-$domain" --quiet
done
metasd train-eagle --corpus eagle-data/code eagle-data/chat eagle-data/math eagle-data/translation \
    --epochs "$epochs" --out specialists/eagle-mixed --quiet
