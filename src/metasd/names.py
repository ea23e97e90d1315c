"""How drafters and policies are spelled where users name them (the CLI, the server's requests, the bench), and the
defaults when they name none. Plain data importing nothing, so that parsing a command line loads no model code."""

DRAFTER_KINDS = (
    "eagle[:HEAD_DIR][:WEIGHTS]",
    "ngram[:MAX_N]",
    "suffix[:DEPTH]",
    "early-exit[:LAYERS]",
    "lm:MODEL[:WEIGHTS]",
    "datastore:PATH",
)
# The pool of `generate`, `serve`, `bench` and `Decoder` when none is given: the EAGLE head shipped for the target
# (where metasd ships one: `drafters.default_pool` drops it otherwise) and the model-free copy drafters
# (docs/decisions.md).
DEFAULT_POOL = ("eagle", "ngram", "suffix")

DEFAULT_POLICY = "metasd-adaptive"

POLICY_NAMES: tuple[str, ...] = (
    "metasd-ucb",
    "metasd-ucb-cost",
    "metasd-fi",
    "metasd-adaptive",
    "ducb",
    "swucb",
    "ducb-cost",
    "swucb-cost",
    "ucb-be",
    "exp3",
    "sequential-halving",
    "random",
    "round-robin",
    "none",
)
