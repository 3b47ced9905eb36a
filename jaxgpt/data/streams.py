"""The random streams' ids: one table, so that two streams never share a number by accident.

Every seeded draw outside the model's own JAX keys comes from NumPy's SeedSequence over a short list of integers,
the run's seed and one of these ids among them (`jaxgpt.data.batches.permutation`, `tasks.rl.rollouts.request_seed`,
a PCG64 generator). Each id must be non-zero (SeedSequence pads short entropy with zeros, so (seed, step) and
(seed, step, 0) would be one stream) and used by one stream only. The numbers are part of the runs already saved:
changing one changes what its stream draws (the batches, splits or samples of a run resumed or repeated), so a new
stream takes a new number and an old one keeps its own.
"""

from __future__ import annotations

EVAL_STREAM = 1  # the windows of language-model evaluation batches (seed, index, EVAL_STREAM)
SPLIT_STREAM = 2  # a set of examples' train/val split (classification snippets)
EXAMPLE_STREAM = 3  # the shuffles of a set of examples, one per epoch (`jaxgpt.data.batches.batch_indices`)
# The built-in generated datasets: conversations (chat and RL) draw from (seed, BUILTIN_STREAM), the copy/reverse
# pairs from (BUILTIN_STREAM, symbols, length), no seed, the same data for every run: where the id stands keeps them
# apart, and saved runs of both were drawn with 5.
BUILTIN_STREAM = 5
ROLLOUT_STREAM = 7  # RL's training rollouts: the sampling seed of each completion
RL_EVAL_STREAM = 8  # RL's evaluation samples (pass@k)
PREFERENCE_STREAM = 9  # the built-in preference pairs' rejected answers (`jaxgpt.data.preferences`)
REJECTED_STREAM = 10  # task dpo's rejected replies sampled from the starting model (`tasks.dpo.rejected`)
LORA_DROPOUT_STREAM = 11  # LoRA dropout's masks: the step key folded with it, apart from the model's own dropout
