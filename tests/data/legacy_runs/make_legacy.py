"""Write run directories with the pre-package layout (commit 6292b6a), for tests/data/legacy_runs."""
import sys, shutil
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/tests")
from tests_helpers import load_tiny, train_run
from jaxgpt.data import prepare_text
out = Path("/work/legacy/legacy_runs"); shutil.rmtree(out, ignore_errors=True); out.mkdir()
text = "".join(Path(m).read_text() for m in ["/usr/lib/python3/dist-packages/README.txt"] if Path(m).exists())
import json.decoder as d
text = Path(d.__file__).read_text()[:12000]
prepare_text([text], out / "data", None, 0.1, "legacy test text", False)
c = load_tiny(data_dir=str(out / "data")); c.workdir = str(out / "lm"); c.max_steps = 4; c.ckpt_interval = 2
c.eval_interval = 2; c.log_interval = 1; c.keep_checkpoints = 1
train_run(c)
c = load_tiny(); c.task = "seq2seq"; c.workdir = str(out / "seq2seq"); c.seq2seq.data = "copy"; c.seq2seq.examples = 200
c.seq2seq.symbols = 8; c.seq2seq.length = 6; c.seq2seq.n_encoder_layer = 1; c.max_steps = 4; c.ckpt_interval = 2
c.eval_interval = 2; c.eval_batches = 1; c.log_interval = 1; c.keep_checkpoints = 1
train_run(c)
