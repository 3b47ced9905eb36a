"""Seed 004's recipe: its one-block Keras GPT trained on wine reviews in word tokens, then asked to continue
"wine review : germany".

Data: Kaggle's wine reviews (https://www.kaggle.com/datasets/zynicide/wine-reviews, file
winemag-data-130k-v2.csv). Kaggle needs a login, so download it yourself and put it at data.csv's default path
or pass --config.data.csv=PATH; without it training stops with one line saying so. Each review with a
country, province, variety and description becomes "wine review : {country} : {province} : {variety} :
{description}" (rows lacking one are skipped, and counted); the words are lower-cased with punctuation split
off, and the 9,998 most frequent plus [PAD] and [UNK] make the article's 10,000-token vocabulary (preparation
prints how many tokens became [UNK]). The dataset is prepared on first use into data/wine_reviews, or ahead of
time with `jaxgpt data --dataset wine_reviews --csv PATH --out data/wine_reviews`.

Windows, not padded rows: the article pads or cuts every review to 80 tokens and trains on those rows; jaxgpt
trains on random 80-token windows of one token stream in which a [PAD] token ends each review. The model so
still learns to end a review with [PAD] (sampling stops there, as the article's generator stops at padding),
its windows are full of text rather than of padding, and a window may span the end of one review and the
start of the next (the [PAD] between them tells it so).

Epochs as steps: the article trains for 20 epochs in batches of 32 reviews. The full CSV has 129,907 complete
reviews (of 129,971 rows), so an epoch is ceil(129,907 / 32) = 4,060 batches and 20 epochs are 81,200 steps of
32 x 80 tokens; each of those windows holds 80 tokens of text where the article's padded rows hold fewer.
`jaxgpt data` prints the review count of your copy: use 20 x ceil(reviews / 32) if it differs.

The article gives no optimizer settings or sampling temperature: training uses Adam with Keras' defaults
(constant rate 1e-3, beta2 0.999, eps 1e-7, no weight decay or clipping), and the closing sample draws from
the model's own distribution (temperature 1) for the 76 tokens that fill the 80-token context.
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/seed004"
    c.data.name = "wine_reviews"
    c.data.dir = "data/wine_reviews"
    c.data.csv = "data/winemag-data-130k-v2.csv"
    c.model = model_fields(get_preset("seed004"), vocab_size=None)  # the dataset's: 10,000 on the full CSV
    c.batch_size = 32
    c.max_steps = 81_200
    c.optim.lr = 1e-3
    c.optim.min_lr = 1e-3
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.b2 = 0.999
    c.optim.eps = 1e-7
    c.optim.grad_clip = 0.0
    c.eval_interval = 2000
    c.ckpt_interval = 2000
    c.sample.prompt = "wine review : germany"
    c.sample.temperature = 1.0
    c.sample.max_new_tokens = 76
    return c
