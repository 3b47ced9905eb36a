"""`python -m jaxgpt COMMAND ...`: the same commands as the `jaxgpt` console script."""

from jaxgpt.commands import main

main()
