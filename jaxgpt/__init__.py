"""jaxgpt: GPT language models in JAX/Flax, from one CPU to TPU pods.

The packages form layers: a module imports only from its own package and the layers listed before it (listed
bottom first, two packages on a line being one layer; `tests/unit/test_layers.py` reads this table and fails on any
import that goes up or sideways).

    errors, storage  user-facing errors, and where files live (local or a bucket): every layer after them reports and
                     reads through them, so they import nothing of jaxgpt but errors
    ops        the kernels and numerics models are built from (attention, projections, losses, platform checks):
               functions of arrays and the attention kernels, importing nothing of model
    model      the Flax models (GPT, encoder-decoder) and their configs and presets, made of ops
    data       text to token ids: tokenizers and their files, datasets, conversations, text pairs, labelled text,
               batches; above model so a reader may size rows by a model's config, below io, which loads weights
               with their tokenizer
    io         weights and checkpoints in and out (jaxgpt runs, Hugging Face directories): a model and its tokenizer
    generate   sampling and decoding from loaded weights: the sampler, the continuous-batching engine, streamed
               text and stop strings
    train      the one training loop, its contract with a task (`train.task.Task`), sharding, optimizer, logs
    evals      scores of a model: text loss, benchmarks, lm-evaluation-harness; they use the loop's sharding and
               the samplers
    tasks      the training objectives (lm, classify, seq2seq, chat, rl, dpo): each builds a `train.task.Task` from
               data, io and generate, and `tasks.build` picks one and gives it what it is evaluated on
    serve, tools  the OpenAI-compatible server; compiling without devices, summaries and plots: programs over all
                  of the above, independent of each other
    commands   the command line (`jaxgpt ...`), the only place that parses flags
"""
