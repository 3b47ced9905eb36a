"""Data preparation throughput on this machine, measured in one run on a generated corpus.

    python benchmarks/bench_data.py              # a 300 MB JSONL corpus, GPT-2 BPE, all cores
    python benchmarks/bench_data.py --mb 1024    # the 1 GB input of the memory target

Three ways to tokenize the same documents, each timed from the files to token ids:
- `jaxgpt data --workers N` (N = the cores): the command as a user runs it, reading JSONL, tokenizing in worker
  processes, writing shards and their sha256; its peak resident memory is the sum over the process tree,
  sampled every 50 ms;
- tiktoken's own `encode_ordinary_batch` with N threads over the documents already in memory, a file's
  documents per call (the machine's limit for this tokenizer: no reading, writing or hashing is timed);
- a single-process loop that encodes one document at a time into a numpy array and writes it (how jaxgpt
  prepared web text before).
The targets (issue 27): jaxgpt data >= 0.8x tiktoken's batch and >= 1.8x the loop on 2 cores; peak resident
memory < 1 GB for a 1 GB input. Needs the GPT-2 ranks (JAXGPT_BPE_FILE or `jaxgpt bpe fetch`) and psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxgpt.data.tokenizer import load_bpe  # noqa: E402

WORDS = [
    'the', 'of', 'and', 'to', 'in', 'is', 'was', 'for', 'on', 'that', 'with', 'as', 'by', 'at', 'from', 'his',
    'her', 'an', 'which', 'were', 'are', 'this', 'be', 'had', 'it', 'not', 'they', 'their', 'been', 'one',
    'all', 'has', 'more', 'first', 'would', 'also', 'new', 'other', 'two', 'after', 'time', 'about', 'into',
    'only', 'over', 'year', 'city', 'world', 'school', 'between', 'during', 'under', 'river', 'music', 'through',
    'family', 'became', 'government', 'system', 'history', 'university', 'league', 'album', 'national', 'however',
    'company', 'several', 'early', 'film', 'series', 'known', 'team', 'state', 'war', 'people', 'because',
    'number', 'while', '1998', '2004', '—', 'café', 'naïve', 'über',
]


def write_corpus(root: Path, megabytes: int, seed: int = 0) -> list[Path]:
    """JSONL files of documents of random words and sentences, about `megabytes` MB in all."""
    rng = np.random.default_rng(seed)
    files, written, i = [], 0, 0
    while written < megabytes * 2**20:
        path = root / f"part_{i:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(4000):
                n = int(rng.integers(200, 1200))
                words = rng.choice(WORDS, n)
                stops = rng.random(n) < 0.08
                text = " ".join(w + ".\n" if s else w for w, s in zip(words, stops, strict=True))
                f.write(json.dumps({"text": text}) + "\n")
        written += path.stat().st_size
        files.append(path)
        i += 1
    return files


def documents(files: list[Path]) -> list[str]:
    """The texts of JSONL files."""
    return [json.loads(line)["text"] for path in files for line in path.open(encoding="utf-8")]


def run_jaxgpt_data(files: list[Path], out: Path, workers: int) -> tuple[float, float]:
    """(seconds, peak resident bytes of the command's process tree)."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "jaxgpt", "data", "--text", *map(str, files), "--tokenizer", "gpt2",
               "--workers", str(workers), "--out", str(out), "--val_fraction", "0.001"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parent, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"jaxgpt data failed: {proc.stderr.read().decode()[-2000:]}")
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="corpus size in MB")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes / threads")
    args = parser.parse_args()
    tokenizer = load_bpe("gpt2")
    encoding = tokenizer._encoding
    with tempfile.TemporaryDirectory() as tmp:
        files = write_corpus(Path(tmp), args.mb)
        n_bytes = sum(p.stat().st_size for p in files)
        print(f"corpus: {len(files)} JSONL files, {n_bytes / 2**20:,.0f} MB; {args.workers} workers/threads; "
              f"{os.cpu_count()} cores")

        seconds, peak = run_jaxgpt_data(files, Path(tmp) / "out", args.workers)
        meta = json.loads((Path(tmp) / "out" / "meta.json").read_text())
        n_tokens = meta["n_train"] + meta["n_val"]
        rates = {f"jaxgpt data --workers {args.workers}": n_tokens / seconds}

        count, seconds = 0, 0.0
        for path in files:  # a file's documents at a time, so the token lists of a large corpus fit in memory
            docs = documents([path])
            t0 = time.perf_counter()
            count += sum(map(len, encoding.encode_ordinary_batch(docs, num_threads=args.workers)))
            seconds += time.perf_counter() - t0
        rates[f"tiktoken encode_ordinary_batch, {args.workers} threads"] = count / seconds

        t0 = time.perf_counter()
        count = 0
        with open(Path(tmp) / "loop.bin", "wb") as out:
            for path in files:
                for line in path.open(encoding="utf-8"):
                    ids = tokenizer.encode_array(json.loads(line)["text"]).astype(np.uint16)
                    out.write(ids.tobytes())
                    count += len(ids) + 1
        rates["one process, one document at a time"] = count / (time.perf_counter() - t0)

    jaxgpt = rates[f"jaxgpt data --workers {args.workers}"]
    print(f"{'route':<48}{'tokens/s':>14}{'jaxgpt data is':>18}")
    for name, rate in rates.items():
        print(f"{name:<48}{rate:>14,.0f}{jaxgpt / rate:>17.2f}x")
    batch_ratio = jaxgpt / rates[f"tiktoken encode_ordinary_batch, {args.workers} threads"]
    loop_ratio = jaxgpt / rates["one process, one document at a time"]
    print(f"jaxgpt data: {batch_ratio:.2f}x tiktoken's batch ({'meets' if batch_ratio >= 0.8 else 'misses'} 0.8x), "
          f"{loop_ratio:.2f}x the one-process loop ({'meets' if loop_ratio >= 1.8 else 'misses'} 1.8x); "
          f"{n_tokens:,} tokens")
    print(f"peak resident memory of jaxgpt data (all its processes): {peak / 2**20:,.0f} MB for "
          f"{n_bytes / 2**20:,.0f} MB of input ({'under' if peak < 2**30 else 'over'} 1 GB)")


if __name__ == "__main__":
    main()
