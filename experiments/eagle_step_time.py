"""An EAGLE head's draft step against the target's one-token forward, both on a ~200-token context of the target's
own answer, with the head on each of its weights (`:unquantized`, `:int8`, and what `auto` chooses here); medians
of 15. The shipped head on the embedded model by default:
python experiments/eagle_step_time.py [--target SPEC --dtype D --head DIR]"""

import argparse
import time

from metasd import Decoder
from metasd.drafters import build_drafter
from metasd.sampling import SamplingParams

GREEDY = SamplingParams()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--head", default="", help="a head directory (default: the one shipped for the target)")
    args = parser.parse_args()
    spec = f"eagle:{args.head}" if args.head else "eagle"
    decoder = Decoder(target=args.target, dtype=args.dtype, drafters=[spec])
    lm = decoder.target_cache
    ids = decoder.encode("Explain how photosynthesis works in plants, step by step, for a high-school student.")
    context = ids + decoder.generate(ids, max_new_tokens=160, policy="none").token_ids

    def target_step() -> float:
        lm.logits_for(context[:-1])
        start = time.perf_counter()
        lm.logits_for(context)
        return time.perf_counter() - start

    for _ in range(3):
        target_step()
    t1 = sorted(target_step() for _ in range(15))[7]
    print(f"context {len(context)} tokens; T(1) {t1 * 1e3:.2f} ms")
    for weights in ("unquantized", "int8", "auto"):
        head = build_drafter(f"{spec}:{weights}", decoder.target)
        head.read_features_from(lm)

        def draft(head=head) -> float:
            lm.logits_for(context)
            head.propose(context + [context[-1]], 1, GREEDY, None)  # catch up first: time the steps alone
            start = time.perf_counter()
            head.propose(context + [context[-1]], 5, GREEDY, None)
            return time.perf_counter() - start

        for _ in range(3):
            draft()
        d5 = sorted(draft() for _ in range(15))[7]
        print(f"{weights} ({head.weights}): 5-token draft {d5 * 1e3:.2f} ms = ", end="")
        print(f"{d5 / 5 * 1e3:.2f} ms per token = {d5 / 5 / t1:.3f} T(1)")


if __name__ == "__main__":
    main()
