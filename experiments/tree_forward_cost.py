"""A tree forward against a chain forward over as many nodes: the embedded model, ~300 cached tokens, medians of 15
(python experiments/tree_forward_cost.py)."""

import statistics
import time

from metasd import Decoder
from metasd.drafters.base import Draft
from metasd.tree import DraftTree

dec = Decoder(drafters="ngram")
lm = dec.target_cache
ids = dec.encode("Explain how photosynthesis works in plants, step by step, for a high-school student.")
ctx = ids + dec.generate(ids, max_new_tokens=200, policy="none").token_ids


def timed(f):
    ts = []
    for _ in range(15):
        lm.logits_for(ctx[:-1])
        s = time.perf_counter()
        f()
        ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e3


t1 = timed(lambda: lm.logits_for(ctx))
for n in (2, 4, 6, 8, 11):
    chain = DraftTree.chain(Draft(list(range(100, 100 + n))))
    tree = DraftTree.chain(Draft(list(range(100, 100 + n // 2))))
    tree.add(1, Draft(list(range(200, 200 + n - n // 2))))
    tc = timed(lambda chain=chain: lm.logits_for_tree(ctx, chain))
    tt = timed(lambda tree=tree: lm.logits_for_tree(ctx, tree))
    print(f"nodes {n}: chain {tc:.1f} ms ({tc / t1:.2f} T1), tree {tt:.1f} ms ({tt / t1:.2f} T1)")
print("T1", round(t1, 1))
