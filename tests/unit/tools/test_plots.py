"""Training curves, attention heatmaps, position codes and the parameter-summary command."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from matplotlib import image as mpimg

from jaxgpt.commands import plots as plots_command
from jaxgpt.commands import summary as summary_command
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model import encdec as seq2seq
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import init_params, stack_layers
from jaxgpt.model.layers import sinusoidal_table
from jaxgpt.model.presets import PRESETS, SEQ2SEQ_PRESETS
from jaxgpt.tools import plots

CHARS = "".join(sorted(set(" .,?HTabcdefghiklmnorstuwy\n")))
CFG = ModelConfig(vocab_size=len(CHARS), block_size=32, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def params() -> dict:
    """Init weights, scaled up so attention is peaked rather than near-uniform (a more telling picture)."""
    p = init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda a: a * 15 if a.ndim > 1 else a, p)


def assert_png(path, min_bytes: int = 10_000) -> np.ndarray:
    """The file is a PNG with real content: big enough and not a single flat color."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > min_bytes
    pixels = mpimg.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05
    return pixels


# ---------------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("scan", [False, True])
def test_attention_maps_are_causal_distributions(params, scan):
    cfg = CFG.replace(scan_layers=scan, attention_impl="xla")  # the data function must force einsum itself
    p = stack_layers(params, CFG.n_layer) if scan else params
    ids = CharTokenizer(CHARS).encode("Hello, how are you today?")
    maps = plots.attention_maps(p, cfg, ids)
    T = len(ids)
    assert maps.shape == (CFG.n_layer, CFG.n_head, T, T)
    assert np.all(maps[..., np.triu_indices(T, k=1)[0], np.triu_indices(T, k=1)[1]] == 0.0)
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
    assert maps.min() >= 0.0
    assert maps[..., 0, 0].min() == pytest.approx(1.0)  # the first token can only see itself
    if scan:  # same numbers whichever way the layers are stored
        np.testing.assert_allclose(maps, plots.attention_maps(params, CFG, ids), atol=1e-6)


def test_attention_maps_reject_bad_prompts(params):
    with pytest.raises(UserError, match="empty"):
        plots.attention_maps(params, CFG, [])
    with pytest.raises(UserError, match="at most 32"):
        plots.attention_maps(params, CFG, [1] * 33)
    with pytest.raises(UserError, match=r"\[0, 27\)"):
        plots.attention_maps(params, CFG, [1, 99])


def test_token_labels_show_whitespace():
    tok = CharTokenizer(CHARS)
    assert plots.token_labels(tok, tok.encode("a b\n")) == ["a", "·", "b", "↵"]


def test_attention_heatmap_png(params, tmp_path):
    tok = CharTokenizer(CHARS)
    ids = tok.encode("To be, or not to be?")
    maps = plots.attention_maps(params, CFG, ids)
    out = plots.plot_attention(maps[1], plots.token_labels(tok, ids), tmp_path / "attn.png", title="layer 1")
    assert_png(out)


def test_attention_cli(params, tmp_path, monkeypatch, capsys):
    """--workdir goes through `weights.load` (faked: a checkpoint with a char tokenizer); --hf through the
    GPT-2 importer, with --ids when the vocabulary has no known tokenizer."""
    from jaxgpt.io.hf import save_hf

    real_load = weights.load
    meta = {"tokenizer": CharTokenizer(CHARS).to_meta()}

    def fake_load(source, which="latest", **kwargs):
        if not source.startswith("workdir:"):
            return real_load(source, which=which, **kwargs)
        assert source == f"workdir:{tmp_path}" and which == "latest"
        return weights.Weights(params, CFG, meta["tokenizer"], meta, "run (latest, step 1)")

    monkeypatch.setattr(weights, "load", fake_load)
    out = tmp_path / "a.png"
    argv = ["attention", "--workdir", str(tmp_path), "--prompt", "How are you?", "--layer", "-1", "--out", str(out)]
    assert plots_command.main(["jaxgpt plots", *argv]) == 0
    assert "4 heads of layer 1, 12 tokens" in capsys.readouterr().out
    assert_png(out)

    save_hf(params, CFG, tmp_path / "hf")
    hf_argv = ["attention", "--hf", str(tmp_path / "hf"), "--layer", "0", "--out", str(tmp_path / "b.png")]
    assert plots_command.main(["jaxgpt plots", *hf_argv, "--ids", "3,4,5,6"]) == 0
    assert_png(tmp_path / "b.png")
    assert plots_command.main(["jaxgpt plots", *hf_argv, "--prompt", "hi"]) == 2
    assert "pass token ids with --ids" in capsys.readouterr().err
    assert plots_command.main(["jaxgpt plots", *argv[:-4], "--layer", "2", "--out", str(out)]) == 2
    assert "layers 0..1" in capsys.readouterr().err


SMALL = dict(n_layer=2, n_embd=32, n_head=2, head_dim=16, d_ff=64, block_size=16)
ENCDEC = SEQ2SEQ_PRESETS["seed002-encdec"].replace(**SMALL, vocab_size=40, n_encoder_layer=3, src_vocab_size=None,
                                                   src_block_size=None)


def test_seq2seq_attention_maps_are_the_sown_weights():
    """Encoder rows over the real source, causal decoder rows, cross rows over the real source: exactly the weights
    each module sows, whatever attention path the config names."""
    params = seq2seq.init_params(ENCDEC, jax.random.key(0))
    params = jax.tree.map(lambda a: a * 4 if a.ndim > 1 else a, params)  # peaked, so the maps differ visibly
    src, tgt = [5, 6, 0, 7, 8], [1, 5, 6, 9]  # source token 0 is padding (seed 002's mask_zero)
    maps = plots.seq2seq_attention_maps(params, ENCDEC.replace(attention_impl="xla", attn_dropout=0.0), src, tgt)
    L, H = ENCDEC.model.n_layer, ENCDEC.model.n_head
    assert maps["encoder"].shape == (3, H, 5, 5) and maps["decoder"].shape == (L, H, 4, 4)
    assert maps["cross"].shape == (L, H, 4, 5)
    sown = jax.jit(lambda p, s, t: seq2seq.Seq2SeqModel(ENCDEC).apply({"params": p}, s, t,
                                                                        mutable=["intermediates"])[1])
    inter = sown(params, np.array([src]), np.array([tgt]))["intermediates"]
    for i in range(L):
        np.testing.assert_allclose(maps["decoder"][i], inter[f"dec_{i}"]["attn"]["attn_weights"][0][0], atol=1e-5)
        np.testing.assert_allclose(maps["cross"][i], inter[f"dec_{i}"]["cross"]["attn_weights"][0][0], atol=1e-5)
    np.testing.assert_allclose(maps["encoder"][2], inter["enc_2"]["attn"]["attn_weights"][0][0], atol=1e-5)
    for kind in ("encoder", "decoder", "cross"):
        np.testing.assert_allclose(maps[kind].sum(-1), 1.0, atol=1e-5)
    assert np.all(maps["cross"][..., 2] == 0) and np.all(maps["encoder"][..., [0, 1, 3, 4], 2] == 0)
    assert np.all(maps["decoder"][..., np.triu_indices(4, k=1)[0], np.triu_indices(4, k=1)[1]] == 0)
    assert maps["cross"].std() > 0.01
    with pytest.raises(UserError, match="the target has 17 tokens"):
        plots.seq2seq_attention_maps(params, ENCDEC, src, [1] * 17)


def test_attention_cli_on_untrained_presets(tmp_path, monkeypatch, capsys):
    """--preset: a GPT preset through weights.load("preset:..."), an encoder-decoder preset with its three kinds
    of attention (shrunk here: the full sizes take a while to initialize on a CPU)."""
    monkeypatch.setitem(PRESETS, "seed002", PRESETS["seed002"].replace(**SMALL, vocab_size=64))
    monkeypatch.setitem(SEQ2SEQ_PRESETS, "seed002-encdec", ENCDEC)
    out = tmp_path / "gpt.png"
    argv = ["jaxgpt plots", "attention", "--preset", "seed002", "--ids", "3,4,0,5,6", "--layer", "1", "--out"]
    assert plots_command.main([*argv, str(out)]) == 0
    assert "2 heads of layer 1, 5 tokens" in capsys.readouterr().out
    assert_png(out)
    out = tmp_path / "encdec.png"
    argv = ["jaxgpt plots", "attention", "--preset", "seed002-encdec", "--ids", "5,6,0,7", "--layer", "-1"]
    assert plots_command.main([*argv, "--target_ids", "1,5,6", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "encoder, decoder and cross-attention of layer 1, 2 heads each; 4 source, 3 target" in said
    assert_png(out)
    assert plots_command.main([*argv[:3], "seed9", "--ids", "1", "--layer", "0", "--out", str(out)]) == 2
    assert "unknown preset 'seed9'" in capsys.readouterr().err
    assert plots_command.main(["jaxgpt plots", "attention", "--preset", "seed002", "--ids", "1", "--target_ids", "2",
                               "--layer", "0", "--out", str(out)]) == 2
    assert "this model is a GPT" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Sinusoidal position codes


@pytest.mark.parametrize("layout", plots.LAYOUTS)
def test_position_panels_are_the_models_tables(layout):
    (kind, table, columns), = plots.position_panels(50, 16, [layout], frequencies=[0, 3])
    assert kind == layout
    np.testing.assert_array_equal(table, sinusoidal_table(50, 16, layout))
    pos = np.arange(50)
    for (sin_label, sin), (cos_label, cos), f in zip(columns[::2], columns[1::2], [0, 3], strict=True):
        angle = pos / 10000 ** (2 * f / 16)
        np.testing.assert_allclose(table[:, sin], np.sin(angle), atol=1e-12)
        np.testing.assert_allclose(table[:, cos], np.cos(angle), atol=1e-12)
        assert sin_label.startswith("sin") and cos_label.startswith("cos")
    default = plots.position_panels(10, 128, [layout])[0][2]  # i = width/32 and width/8
    assert [label.split(" (")[0] for label, _ in default] == ["sin, i=4", "cos, i=4", "sin, i=16", "cos, i=16"]


def test_position_panel_errors():
    with pytest.raises(UserError, match="even width"):
        plots.position_panels(10, 7)
    with pytest.raises(UserError, match=r"frequency indices \[8\] do not exist for width 16"):
        plots.position_panels(10, 16, frequencies=[8])
    with pytest.raises(UserError, match="unknown position layouts"):
        plots.position_panels(10, 16, ["learned"])


def test_positions_png_and_cli(tmp_path, capsys):
    out = tmp_path / "positions.png"
    assert plots_command.main(["jaxgpt plots", "positions", "--length", "64", "--width", "32", "--out", str(out)]) == 0
    assert "sinusoidal, sinusoidal_concat: 64 positions x 32 dimensions" in capsys.readouterr().out
    assert_png(out)
    argv = ["jaxgpt plots", "positions", "--width", "32", "--frequencies", "1,16", "--out", str(out)]
    assert plots_command.main(argv) == 2
    err = capsys.readouterr().err
    assert "choose from 0..15" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------
# Training curves


def write_metrics(workdir, steps: int = 60, torn_last_line: bool = True) -> None:
    """A metrics.jsonl shaped like the trainer's: periodic records, evaluation records, a resume that
    repeats two steps, and (optionally) a half-written last line."""
    lines = []
    for step in range(10, steps + 1, 10):
        loss = 4.0 * np.exp(-step / 30) + 1.0
        lines.append({"step": step, "train_loss": loss, "lr": 1e-3 * min(1.0, step / 20), "grad_norm": 1 / step,
                      "tokens_per_sec": 9000 + 100 * np.sin(step)})
        if step % 20 == 0:
            lines.append({"step": step, "train_loss": loss - 0.05, "val_loss": loss + 0.1})
    lines += lines[-2:]  # logged again after resuming from a checkpoint
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if torn_last_line:
        text += '{"step": 70, "train_lo'
    (workdir / plots.METRICS_FILE).write_text(text)


def test_metric_series(tmp_path):
    write_metrics(tmp_path)
    records = plots.read_metrics(tmp_path)
    steps, values = plots.metric_series(records, "train_loss", eval_records=False)
    assert steps.tolist() == [10, 20, 30, 40, 50, 60]
    assert values[0] == pytest.approx(4.0 * np.exp(-1 / 3) + 1.0)
    val_steps, _ = plots.metric_series(records, "val_loss")
    assert val_steps.tolist() == [20, 40, 60]
    eval_steps, eval_train = plots.metric_series(records, "train_loss", eval_records=True)
    assert eval_steps.tolist() == [20, 40, 60] and eval_train[0] == pytest.approx(values[1] - 0.05)


def test_metrics_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        plots.read_metrics(tmp_path)
    (tmp_path / plots.METRICS_FILE).write_text('{"step": 1, "lr": 0.1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2 is not valid JSON"):
        plots.read_metrics(tmp_path)
    (tmp_path / plots.METRICS_FILE).write_text('{"event": "start"}\n')
    with pytest.raises(UserError, match="no records"):
        plots.read_metrics(tmp_path)


def test_curves_png_and_cli(tmp_path, capsys):
    write_metrics(tmp_path, steps=200)
    out = tmp_path / "plots" / "curves.png"
    assert plots_command.main(["jaxgpt plots", "curves", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_png(out)
    assert plots_command.main(["jaxgpt plots", "curves", "--workdir", str(tmp_path / "none"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_curves_with_missing_quantities(tmp_path):
    (tmp_path / plots.METRICS_FILE).write_text("".join(json.dumps({"step": s, "train_loss": 3.0 / s}) + "\n"
                                                       for s in range(1, 30)))
    assert_png(plots.plot_training_curves(plots.read_metrics(tmp_path), tmp_path / "c.png"))


# ---------------------------------------------------------------------------------------------------
# Parameter summary command


def test_summary_command_gpt2(capsys):
    assert summary_command.main(["jaxgpt summary", "--preset", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("124,439,808")
    assert "wte" in out and "h_11/mlp" in out and "4,722,432" in out


def test_summary_command_config_and_errors(tmp_path, capsys):
    (tmp_path / "m.json").write_text(json.dumps({"model": {"vocab_size": 10, "n_layer": 1, "n_embd": 8,
                                                           "n_head": 2, "block_size": 4}}))
    assert summary_command.main(["jaxgpt summary", "--config", str(tmp_path / "m.json")]) == 0
    # wte 80 + wpe 32 + ln 2*16 + attn (8*24+24 + 8*8+8) + mlp (8*32+32 + 32*8+8) + ln_f 16
    assert capsys.readouterr().out.rstrip().endswith(f"{80 + 32 + 32 + 288 + 552 + 16:,}")
    assert summary_command.main(["jaxgpt summary", "--preset", "gpt5"]) == 2
    assert "unknown model preset 'gpt5'" in capsys.readouterr().err


def test_summary_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "jaxgpt", "summary", "--preset", "gpt2-medium"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("354,823,168")


def test_summary_command_knows_encoder_decoder_presets(capsys):
    assert summary_command.main(["jaxgpt summary", "--preset", "seed002-encdec"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("179,600,384")  # seed 002's Keras summary: 64,067,584 + 114,482,176 + 1,050,624
    assert "enc_5/attn" in out and "dec_5/cross" in out
