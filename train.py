"""Train a GPT: python train.py --config configs/NAME.py [--config.key=value ...].

A thin command line over `jaxgpt.trainer.train`; see README.md for the configs and their keys.
"""

from jaxgpt.cli import run_config_command, use_huge_pages


def print_sample(c, result: dict) -> None:
    """A taste of the trained model: config.sample's prompt continued with the KV-cache sampler."""
    import jax

    from jaxgpt.sampling import stream
    from jaxgpt.tokenizer import tokenizer_from_meta

    if c.sample.max_new_tokens <= 0 or jax.process_index() != 0:
        return
    tokenizer = tokenizer_from_meta(result["tokenizer_meta"], c.data.bpe_file or None)
    params = result["state"]["params"]
    if all(p.is_fully_addressable and p.sharding.is_fully_replicated for p in jax.tree.leaves(params)):
        params = jax.device_put(params, jax.local_devices()[0])  # data-parallel copies: decode on one device
    prompt = tokenizer.encode(c.sample.prompt) or [tokenizer.eot_token or 0]
    print(f"--- sample (temperature {c.sample.temperature}) ---\n{c.sample.prompt}", end="", flush=True)
    for chunk in stream(params, result["model_cfg"], prompt, max_new_tokens=c.sample.max_new_tokens,
                        key=c.seed, temperature=c.sample.temperature, top_k=c.sample.top_k or None,
                        top_p=c.sample.top_p, eot_token=tokenizer.eot_token):
        print(tokenizer.decode(chunk[0].tolist()), end="", flush=True)
    print("\n---")


def train_and_sample(c) -> None:
    from jaxgpt.trainer import train

    print_sample(c, train(c))


if __name__ == "__main__":
    use_huge_pages()
    run_config_command(train_and_sample, example="configs/stdlib_char.py", keys_in="jaxgpt/train_config.py")
