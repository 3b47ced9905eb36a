"""Fetch and check the GPT-2 BPE ranks file (`gpt2.tiktoken`) through PyPI, for machines without tiktoken's host.

tiktoken downloads the ranks from openaipublic.blob.core.windows.net, which offline and locked-down
machines cannot reach. The openai-whisper source package on PyPI ships a byte-identical copy
(whisper/assets/gpt2.tiktoken, sha256 `tokenizer.R50K_SHA256`), so `fetch` asks pip for that package,
extracts the one file, checks its hash and renames it into place (`tokenizer.configured_bpe_file()`,
where `tokenizer.load_bpe` looks when no --bpe_file is given). The command line is `jaxgpt bpe fetch`;
`.ci/provision_bpe.sh` does the same in shell.

The file is not shipped inside jaxgpt, although its licences would allow it (see docs/data.md, "GPT-2 BPE offline").
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from jaxgpt.data.tokenizer import BPE_FILE_ENV, R50K_SHA256, configured_bpe_file
from jaxgpt.errors import UserError

WHISPER_SDIST = "openai-whisper==20250625"
RANKS_MEMBER = "/whisper/assets/gpt2.tiktoken"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_valid(path: Path) -> bool:
    """Whether `path` holds exactly the GPT-2 ranks."""
    return path.is_file() and sha256_of(path) == R50K_SHA256


def _download_sdist(directory: Path) -> Path:
    """pip's own download of the whisper source package (no install, no dependencies)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               WHISPER_SDIST, "-d", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"pip could not download {WHISPER_SDIST} ({last}): check access to PyPI, or copy a "
                        f"gpt2.tiktoken from elsewhere and point {BPE_FILE_ENV} at it")
    sdists = sorted(directory.glob("openai[-_]whisper-*.tar.gz"))
    if not sdists:
        raise UserError(f"pip downloaded no openai-whisper source package into {directory}")
    return sdists[0]


def _extract_ranks(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(RANKS_MEMBER)]
        if not members:
            raise UserError(f"{sdist.name} has no {RANKS_MEMBER.lstrip('/')}")
        out.write_bytes(tar.extractfile(members[0]).read())


def fetch(dest: Path | None = None) -> tuple[Path, bool]:
    """Make `dest` (default: `tokenizer.configured_bpe_file()`, where `load_bpe` looks) hold the checked ranks;
    returns (path, whether it was fetched).

    A file already there with the right hash is kept. The new file is checked before it is renamed into
    place, so `dest` is only ever absent, the old file, or the right ranks.
    """
    dest = Path(dest) if dest is not None else configured_bpe_file()
    if is_valid(dest):
        return dest, False
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {dest.parent} ({e.strerror}): choose another --dest") from None
    with tempfile.TemporaryDirectory() as tmp:
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
        try:
            _extract_ranks(_download_sdist(Path(tmp)), partial)
            actual = sha256_of(partial)
            if actual != R50K_SHA256:
                raise UserError(f"the extracted ranks have sha256 {actual}, not the GPT-2 ranks' {R50K_SHA256}")
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    return dest, True
