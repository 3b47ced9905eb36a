"""Sample text from a jaxgpt model, from a checkout: `python sample.py --help` (the same as `jaxgpt sample`)."""

import sys

from jaxgpt.commands import use_huge_pages

if __name__ == "__main__":
    use_huge_pages()  # restarts the process: before the command's heavy imports (jax), not after
    from jaxgpt.commands.sample import main

    sys.exit(main())
