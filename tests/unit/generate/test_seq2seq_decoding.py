"""Encoder-decoder decoding: the cached loop against the uncached reference, sampling, beam search, the CLI."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from helpers.seq2seq import BOS, PAD, random_params, tiny
from reference.sampling_reference import seq2seq_uncached

from jaxgpt.commands import sample as cli
from jaxgpt.data import pairs
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.generate import seq2seq as dec
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.encdec import Seq2SeqModel

VARIANTS = {  # the default tests share the first one's compilations
    "pre-learned-tied": {},
    "post-sinusoidal-untied": dict(norm_placement="post", final_norm=False, position="sinusoidal_concat",
                                   scale_embeddings=True, tie_embeddings=False, share_embeddings=True,
                                   src_vocab_size=11),
}


def padded_sources(cfg: Seq2SeqConfig, seed: int = 0) -> jax.Array:
    """Three sources of different lengths (full, 4 pad, one real token), right-padded with pad_id."""
    rng = np.random.default_rng(seed)
    S = cfg.src_block_size
    src = rng.integers(PAD + 1, cfg.src_vocab_size, size=(3, S))
    src[1, -4:] = PAD
    src[2, 1:] = PAD
    return jnp.asarray(src, jnp.int32)


@functools.cache
def setup(cfg: Seq2SeqConfig) -> tuple[dict, jax.Array, int]:
    """Parameters, padded sources, and an eos id that row 0's greedy output contains by step 2 (so finishing
    rows is exercised): one per config, so tests share compilations (eos is a static argument)."""
    params, src = random_params(cfg), padded_sources(cfg)
    tokens, _ = seq2seq_uncached(params, cfg, src, bos_id=BOS, eos_id=-1, max_new_tokens=cfg.model.block_size)
    return params, src, int(tokens[0, 2])


def assert_padded_after_eos(tokens: np.ndarray, eos: int, fill: int) -> None:
    for row in np.asarray(tokens):
        hits = np.flatnonzero(row == eos)
        if hits.size:
            assert (row[hits[0] + 1:] == fill).all(), row


def live_steps(tokens: np.ndarray, eos: int) -> np.ndarray:
    """(B, N) True up to and including each row's eos: the steps whose logits mean something."""
    is_eos = np.asarray(tokens) == eos
    return np.cumsum(is_eos, axis=1) - is_eos == 0


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_greedy_equals_uncached_tokens_and_logits(variant: str) -> None:
    cfg = tiny(**VARIANTS[variant])
    params, src, eos = setup(cfg)
    N = cfg.model.block_size
    want, want_logits = seq2seq_uncached(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=N)
    got, got_logits = dec.generate(params, cfg, src, None, 1.0, 1.0, spec=dec.GREEDY, bos_id=BOS, eos_id=eos,
                                   max_new_tokens=N, return_logits=True)
    np.testing.assert_array_equal(got, want)
    live = live_steps(want, eos)
    np.testing.assert_allclose(np.asarray(got_logits)[live], want_logits[live], atol=1e-5, rtol=1e-5)
    assert (want[0] == eos).any() and not live.all()  # the test exercised a finished row
    assert_padded_after_eos(got, eos, PAD)


def test_greedy_traces_inside_another_jit_and_shorter_outputs_are_prefixes() -> None:
    cfg = tiny()
    params, src, eos = setup(cfg)
    outer = jax.jit(lambda p, s: dec.greedy(p, cfg, s, bos_id=BOS, eos_id=eos, max_new_tokens=3) * 2)
    full = dec.greedy(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8)
    np.testing.assert_array_equal(outer(params, src), 2 * np.asarray(full)[:, :3])


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_sampling_with_a_key_equals_uncached(options: dict) -> None:
    cfg = tiny()
    params, src, eos = setup(cfg)
    key = jax.random.key(3)
    got = dec.sample(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8, key=key, **options)
    want, _ = seq2seq_uncached(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8, key=key, **options)
    np.testing.assert_array_equal(got, want)
    assert_padded_after_eos(got, eos, PAD)
    other = dec.sample(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8, key=jax.random.key(4), **options)
    assert not np.array_equal(got, other)


def test_top_k_one_and_temperature_zero_are_greedy() -> None:
    cfg = tiny()
    params, src, eos = setup(cfg)
    greedy = dec.greedy(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8)
    for options in (dict(top_k=1, temperature=1.5), dict(temperature=0.0)):
        np.testing.assert_array_equal(dec.sample(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8,
                                                 key=jax.random.key(0), **options), greedy)


@functools.cache
def _forward(cfg: Seq2SeqConfig):
    return jax.jit(lambda params, src, tgt: Seq2SeqModel(cfg).apply({"params": params}, src, tgt))


def sequence_log_probs(params: dict, cfg: Seq2SeqConfig, src_1S: jax.Array, seqs_HN: np.ndarray, eos: int
                       ) -> np.ndarray:
    """Total log-probability of each hypothesis (tokens up to and including eos) by teacher forcing."""
    H = seqs_HN.shape[0]
    tgt_HN = np.concatenate([np.full((H, 1), BOS), seqs_HN[:, :-1]], axis=1)
    logits = _forward(cfg)(params, jnp.repeat(src_1S, H, axis=0), jnp.asarray(tgt_HN, jnp.int32))
    lp_HN = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), seqs_HN[..., None], axis=-1)[..., 0]
    return (lp_HN * live_steps(seqs_HN, eos)).sum(axis=1)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_one_beam_is_greedy(alpha: float) -> None:
    cfg = tiny()
    params, src, eos = setup(cfg)
    greedy = np.asarray(dec.greedy(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=8))
    tokens, logp = dec.beam_search(params, cfg, src, alpha, bos_id=BOS, eos_id=eos, max_new_tokens=8, beam_size=1)
    np.testing.assert_array_equal(tokens, greedy)
    want = [sequence_log_probs(params, cfg, src[b:b + 1], greedy[b:b + 1], eos)[0] for b in range(3)]
    np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)


def all_hypotheses(V: int, N: int, eos: int) -> np.ndarray:
    """Every output of at most N tokens (pad never emitted; eos ends one early), padded with pad: (H, N)."""
    words = [t for t in range(V) if t not in (PAD, eos)]
    out = []
    for length in range(1, N + 1):
        for prefix in itertools.product(words, repeat=length - 1):
            out.append([*prefix, eos] + [PAD] * (N - length))
    out += [list(p) for p in itertools.product(words, repeat=N)]
    return np.array(out, np.int32)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_enough_beams_find_the_exhaustive_optimum_which_greedy_misses(alpha: float) -> None:
    """Vocabulary {pad, bos, eos, a, b}, 3 tokens: 40 hypotheses, all of which 40 beams can hold at once."""
    cfg = tiny(vocab_size=5, block_size=3, n_embd=8, d_ff=8, n_layer=1, n_encoder_layer=1)
    params, eos, N = random_params(cfg, seed=2), 2, 3
    src = jnp.asarray(np.random.default_rng(1).integers(1, cfg.src_vocab_size, size=(8, 5)), jnp.int32)
    hyps = all_hypotheses(5, N, eos)
    assert len(hyps) == 40
    lengths = live_steps(hyps, eos).sum(axis=1)
    tokens, logp = dec.beam_search(params, cfg, src, alpha, bos_id=BOS, eos_id=eos, max_new_tokens=N, beam_size=40)
    greedy = np.asarray(dec.greedy(params, cfg, src, bos_id=BOS, eos_id=eos, max_new_tokens=N))
    greedy_worse = 0
    for b in range(src.shape[0]):
        scores = sequence_log_probs(params, cfg, src[b:b + 1], hyps, eos)
        scores /= np.asarray(dec.length_normalizer(lengths, alpha))
        best, greedy_at = int(np.argmax(scores)), np.flatnonzero((hyps == greedy[b]).all(axis=1))[0]
        np.testing.assert_array_equal(tokens[b], hyps[best])
        np.testing.assert_allclose(logp[b], scores[best] * dec.length_normalizer(lengths[best], alpha), rtol=1e-5)
        greedy_worse += bool(scores[best] > scores[greedy_at] + 1e-4)
    assert greedy_worse > 0 or alpha > 0  # some source where greedy decoding is not the most likely output


def test_beam_search_pads_after_eos_and_scores_what_it_returns() -> None:
    cfg = tiny()
    params, src, eos = setup(cfg)
    tokens, logp = dec.beam_search(params, cfg, src, 0.6, bos_id=BOS, eos_id=eos, max_new_tokens=8, beam_size=4)
    assert_padded_after_eos(tokens, eos, PAD)
    assert not (np.asarray(tokens)[live_steps(tokens, eos)] == PAD).any()
    want = [sequence_log_probs(params, cfg, src[b:b + 1], np.asarray(tokens[b:b + 1]), eos)[0] for b in range(3)]
    np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda p, c, s: dec.greedy(p, c, s, bos_id=BOS, eos_id=2, max_new_tokens=9), "block_size=8"),
    (lambda p, c, s: dec.beam_search(p, c, s, bos_id=BOS, eos_id=2, max_new_tokens=4, beam_size=0), "beam_size"),
    (lambda p, c, s: dec.sample(p, c, s, bos_id=BOS, eos_id=2, max_new_tokens=4, key=jax.random.key(0), top_p=0),
     "top_p"),
])
def test_bad_options_are_user_errors(call, message: str) -> None:
    cfg = tiny()
    params, src, _ = setup(cfg)
    with pytest.raises(UserError, match=message):
        call(params, cfg, src)


# ----------------------------------------------------------------------------------------------------
# The command line

CHARS = "abcdefgh"  # text ids 0..7 -> model ids 3..10: TINY's 11-token vocabulary


def write_run(workdir: Path, cfg: ModelConfig | Seq2SeqConfig, params: dict, seq2seq: bool) -> Path:
    """A work directory with one checkpoint, as the trainer writes it (a seq2seq run's meta has its specials)."""
    from jaxgpt.io.checkpoint import Checkpointer

    meta = {"model": cfg.to_dict(), "tokenizer": CharTokenizer(CHARS).to_meta(), "val_loss": 1.0}
    ckpt = Checkpointer(workdir)
    ckpt.save({"params": params, "opt_state": {"count": jnp.zeros((), jnp.int32)}, "step": 1},
              {**meta, "seq2seq": dict(pairs.SPECIALS)} if seq2seq else meta)
    ckpt.close()
    return workdir


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("seq2seq_run"), tiny(), setup(tiny())[0], seq2seq=True)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["jaxgpt sample", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_decodes_sources_as_the_library_does(seq2seq_run: Path, capsys, tmp_path: Path) -> None:
    cfg = tiny()
    params = setup(cfg)[0]
    sources = ["abc", "hgfedcba", "d"]
    tok = CharTokenizer(CHARS)
    src = cli.encode_sources(cfg, tok, pairs.SPECIALS, sources)
    assert src.shape == (3, 8) and src[2, 1] == PAD
    want = [pairs.decode_ids(tok, pairs.SPECIALS, row) for row in
            np.asarray(dec.greedy(params, cfg, src, bos_id=BOS, eos_id=2, max_new_tokens=8))]
    lines = tmp_path / "sources.txt"
    lines.write_text("\n".join(sources) + "\n")
    code, out, err = run_cli(["--workdir", str(seq2seq_run), "--source_file", str(lines)], capsys)
    assert code == 0, err
    assert out.split("\n") == [*want, ""]
    code, out, err = run_cli(["--workdir", str(seq2seq_run), "--source", "abc", "--beam_size", "1"], capsys)
    assert (code, out) == (0, want[0] + "\n"), err
    code, out, err = run_cli(["--workdir", str(seq2seq_run), "--source", "abc", "--temperature", "0.8",
                              "--max_new_tokens", "4"], capsys)
    assert code == 0 and len(out) <= 5, err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "abc"], "--prompt: for a GPT's prompt; this run is an encoder-decoder: give the text to "
                          "decode with --source TEXT"),
    ([], "give the text to decode with --source TEXT or --source_file PATH"),
    (["--source", "abcdefghabcdefgh"], "the source is 16 tokens, longer than the model's src_block_size=9"),
    (["--source", "abz"], "'z'"),
    (["--source", ""], "the source is empty"),
    (["--source", "ab", "--max_new_tokens", "9"], "max_new_tokens=9 must be in [1, block_size=8]"),
    (["--source", "ab", "--beam_size", "2", "--top_k", "3"], "--beam_size searches for the most likely output: "
                                                              "drop --top_k"),
    (["--source", "ab", "--beam_size", "0"], "beam_size=0 must be a positive integer"),
])
def test_cli_seq2seq_mistakes_are_one_line(seq2seq_run: Path, capsys, args: list[str], message: str) -> None:
    code, out, err = run_cli(["--workdir", str(seq2seq_run), *args], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_cli_source_on_a_gpt_names_prompt(tmp_path: Path, capsys) -> None:
    from jaxgpt.model.gpt import init_params

    cfg = ModelConfig(vocab_size=len(CHARS), block_size=8, n_layer=1, n_head=2, n_embd=16)
    run = write_run(tmp_path / "gpt", cfg, init_params(cfg, jax.random.key(0)), seq2seq=False)
    code, _, err = run_cli(["--workdir", str(run), "--source", "abc"], capsys)
    assert code == 2 and "--source need an encoder-decoder run (task seq2seq); this model is a GPT: give the text " \
                          "to continue with --prompt" in err, err


@pytest.mark.slow
def test_train_copy_task_then_decode_from_the_command_line(tmp_path: Path, capsys) -> None:
    """configs/seq2seq_copy.py, shrunk to seconds, trained by the train command; sample decodes its sources."""
    from jaxgpt.commands import train as train_command

    config = ROOT / "configs" / "seq2seq_copy.py"
    overrides = dict(workdir=tmp_path / "run", max_steps=30, eval_interval=30, ckpt_interval=30, eval_batches=1,
                     batch_size=16, cpu_devices=0, compilation_cache_dir="", **{"model.n_embd": 32,
                     "model.n_layer": 1, "model.block_size": 12, "seq2seq.n_encoder_layer": 1, "seq2seq.examples": 500})
    args = ["train.py", f"--config={config}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    assert train_command.main(args) == 0
    capsys.readouterr()
    code, out, err = run_cli(["--workdir", str(tmp_path / "run"), "--source", "abcd", "--beam_size", "3"], capsys)
    assert code == 0 and out.count("\n") == 1, err
    code, _, err = run_cli(["--workdir", str(tmp_path / "run"), "--source", "abcdefghij" * 2], capsys)
    assert code == 2 and "longer than the model's src_block_size" in err, err
