"""A tiny random Llama chat model as a Hugging Face directory, made by transformers (needs torch and transformers).

Its tokenizer is a byte-level BPE trained here with ChatML's special tokens, a SmolLM2-like template (a default
system message, <|im_start|>ROLE\\n ... <|im_end|>\\n) and two stop tokens; the model's vocabulary is padded past
the tokenizer's (`PADDED` more ids), as many released models' are.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["What is 2 + 3? It is 5.", "Spell 'abc' backwards: cba.", "the quick brown fox jumps over the lazy dog",
         "You are a helpful assistant.", "system user assistant", "Hello! How are you today?"]
PADDED = 24  # ids past the tokenizer's that the model has and no text is


def byte_level_bpe(texts: list[str], specials: list[str], vocab_size: int) -> object:
    """A `tokenizers.Tokenizer`: byte-level BPE (as Llama 3's, Qwen's and SmolLM2's) trained on `texts`, with
    `specials` first (ids 0, 1, ...)."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return backend


def save_tiny_llama(root: Path, **config: object) -> tuple[object, object]:
    """(transformers model, its tokenizer) saved to `root`; `config` overrides LlamaConfig's tiny sizes."""
    import torch
    import transformers

    backend = byte_level_bpe(TEXTS * 4, SPECIALS, 360)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                                     eos_token="<|im_end|>", chat_template=TEMPLATE,
                                                     clean_up_tokenization_spaces=False)
    vocab = backend.get_vocab_size()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{
        "vocab_size": vocab + PADDED, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 1,
        "eos_token_id": [2, 0], "pad_token_id": None, "tie_word_embeddings": False, **config})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a spread where greedy answers are not all one token
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.ndim == 2 else p.fill_(1.0)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 0]).save_pretrained(root)
    return model, tokenizer
