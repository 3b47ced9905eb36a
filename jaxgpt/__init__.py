"""jaxgpt: GPT language models in JAX/Flax, from one CPU to TPU pods."""
