"""The Annotated Transformer's recipe (seed 000) on your own sentence pairs: pass the data, nothing else.

    python train.py --config configs/annotated_transformer.py --config.seq2seq.data=fra.txt

Data: a TSV of source<TAB>target lines (Tatoeba/Anki files such as fra.txt work as they are: their third,
attribution column is ignored) or JSONL of {"source": ..., "target": ...}. There is no default: a missing
path is a one-line error. The recipe: the base model of "Attention is all you need" (the
`seed000-encdec` preset: 6 + 6 pre-norm layers, 512 wide, 8 heads, feed-forward 2048, sinusoidal
positions, dropout 0.1, separate source/target tables and output layer as in the Annotated Transformer's
code), word tokens, Adam with betas (0.9, 0.98) and eps 1e-9, no weight decay or clipping, the Noam
schedule (factor 1, 4000 warmup steps) and label smoothing 0.1. Sized for accelerators: on a CPU, start
from configs/seq2seq_copy.py's small model instead.
"""

from jaxgpt.model.presets import get_seq2seq_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    preset = get_seq2seq_preset("seed000-encdec")
    c.task = "seq2seq"
    c.workdir = "runs/annotated_transformer"
    c.seq2seq.data = ""  # required: --config.seq2seq.data=PATH
    c.seq2seq.tokenizer = "word"
    c.seq2seq.word_vocab = 10000
    c.seq2seq.val_fraction = 0.05
    c.seq2seq.n_encoder_layer = preset.n_encoder_layer
    c.seq2seq.share_embeddings = preset.share_embeddings
    # vocab_size: the pairs' words; block_size: pairs with a longer source or target are skipped.
    c.model = model_fields(preset.model, vocab_size=None, block_size=72)
    c.batch_size = 128
    c.max_steps = 20000
    c.optim.schedule = "noam"
    c.optim.lr = 1.0  # the Noam factor: the peak rate is 1.0 / sqrt(512 * 4000) = 7.0e-4
    c.optim.warmup_steps = 4000
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-9
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 0.0
    c.label_smoothing = 0.1
    c.eval_interval = 1000
    c.eval_batches = 8
    c.ckpt_interval = 1000
    return c
