"""The shipped EAGLE head's draft step against the target's one-token forward, both on a ~200-token context of the
target's own answer, with the head on each of its weights (`eagle:unquantized`, `eagle:int8`, and what `eagle`
chooses here); medians of 15 (python experiments/eagle_step_time.py)."""

import time

from metasd import Decoder
from metasd.drafters import build_drafter
from metasd.sampling import SamplingParams

GREEDY = SamplingParams()


def main() -> None:
    decoder = Decoder()
    lm = decoder._lm
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
    for spec in ("eagle:unquantized", "eagle:int8", "eagle"):
        head = build_drafter(spec, decoder.target)
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
        print(f"{spec} ({head.weights}): 5-token draft {d5 * 1e3:.2f} ms = ", end="")
        print(f"{d5 / 5 * 1e3:.2f} ms per token = {d5 / 5 / t1:.3f} T(1)")


if __name__ == "__main__":
    main()
