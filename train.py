"""Train a model: python train.py --config configs/NAME.py [--config.key=value ...] (= `jaxgpt train`)."""

import sys

from jaxgpt.commands import use_huge_pages
from jaxgpt.commands.train import main

if __name__ == "__main__":
    use_huge_pages()
    sys.exit(main())
