"""Where learning from code traffic helps the head: its first draft token's acceptance (k = 1) on the last 50 code
prompts, before and after learning from the first 150, split by whether the free drafters' first token (n-gram on the
context, suffix with the 150 earlier answers) was right at that position. Both heads decode the same greedy output;
each round the head drafts counts at the output position it drafted for.
Usage: python experiments/learning_overlap.py"""

import collections
import copy
import json

from learning_curve import FrozenLearning, code_prompts

from metasd import Decoder
from metasd.drafters.ngram import NgramDrafter
from metasd.learning import LearningConfig, learn_heads
from metasd.sampling import SamplingParams


def main() -> None:
    ps = code_prompts(200)
    dec = Decoder()
    eagle = next(n for n in dec.drafter_names if n.startswith("eagle"))
    drafter = dec.drafters[eagle]
    (learner,) = learn_heads(dec, LearningConfig(train_every=2048, share=0.5, nice=0))
    learner.start()
    for i, p in enumerate(ps[:150]):
        dec.generate(p, max_new_tokens=64, policy=f"fixed:{eagle}")
        if i % 25 == 24:
            print(i + 1, learner.current("")[0], flush=True)
    learner.close()
    version, head = learner.current("")
    print("version at 150:", version, flush=True)
    suffix = copy.deepcopy(dec.drafters["suffix"])  # history of the 150 answers
    drafter.learn_from(FrozenLearning(version, copy.deepcopy(head)))
    dec.draft_len = 1
    greedy = SamplingParams(0.0, 0, 1.0, 0)
    ngram = NgramDrafter()
    cells = collections.Counter()
    for p in ps[150:]:
        ids = dec.encode(p)
        outs = {}
        for arm, key in (("learned", ""), ("loaded", None)):
            drafter.use_history(key)
            r = dec.generate(p, max_new_tokens=64, policy=f"fixed:{eagle}")
            outs[arm] = r
        out = list(outs["loaded"].token_ids)
        assert out == list(outs["learned"].token_ids)
        suffix.begin(ids)
        free_right = []
        for j in range(len(out)):
            ctx = ids + out[:j]
            a = ngram.propose(ctx, 1, greedy, None).tokens[:1] == [out[j]]
            b = suffix.propose(ctx, 1, greedy, None).tokens[:1] == [out[j]]
            free_right.append(a or b)
        for arm, r in outs.items():
            pos = 0
            for rd in r.stats.rounds:
                if rd.drafter == eagle and rd.drafted >= 1 and pos < len(out):
                    cells[arm, free_right[pos], "rounds"] += 1
                    cells[arm, free_right[pos], "accepted"] += rd.accepted >= 1
                pos += rd.emitted
    summary = {}
    for arm in ("learned", "loaded"):
        for fr in (True, False):
            n = cells[arm, fr, "rounds"]
            rate = round(cells[arm, fr, "accepted"] / max(n, 1), 3)
            summary[f"{arm} free_right={fr}"] = {"rounds": n, "accept_rate": rate}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
