#!/usr/bin/env bash
# Provision the GPT-2 BPE ranks (r50k_base.tiktoken, a.k.a. gpt2.tiktoken) without touching the internet
# at large: CI machines can reach the Python package index but not openaipublic.blob.core.windows.net,
# where tiktoken would download them from. The openai-whisper sdist on PyPI ships a byte-identical copy
# as whisper/assets/gpt2.tiktoken, so we fetch that sdist and extract the one file.
#
# Usage: .ci/provision_bpe.sh [DEST]      (default DEST: $HOME/.cache/jaxgpt/gpt2.tiktoken)
#        PYTHON=/path/to/python .ci/provision_bpe.sh   to choose the interpreter whose pip is used.
# Then:  export JAXGPT_BPE_FILE=DEST
# Idempotent: exits early when DEST already holds the file with the expected sha256.
set -euo pipefail

dest="${1:-$HOME/.cache/jaxgpt/gpt2.tiktoken}"
python="${PYTHON:-python3}"
expected_sha256="306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
whisper_pin="openai-whisper==20250625"

sha256_of() {
    "$python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"
}

if [[ -f "$dest" && "$(sha256_of "$dest")" == "$expected_sha256" ]]; then
    echo "provision_bpe: $dest already present (sha256 ok)"
    exit 0
fi

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

"$python" -m pip download --quiet --no-deps "$whisper_pin" -d "$workdir"

# Extract to a temp file next to DEST, check the hash, then rename: DEST is either absent or correct.
mkdir -p "$(dirname "$dest")"
partial="$dest.partial.$$"
"$python" - "$workdir" "$partial" <<'EOF'
import pathlib, sys, tarfile

workdir, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sdists = sorted(workdir.glob("openai_whisper-*.tar.gz")) + sorted(workdir.glob("openai-whisper-*.tar.gz"))
if not sdists:
    sys.exit(f"provision_bpe: pip did not download an openai-whisper sdist into {workdir}")
with tarfile.open(sdists[0]) as tar:
    members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith("/whisper/assets/gpt2.tiktoken")]
    if not members:
        sys.exit(f"provision_bpe: {sdists[0].name} has no whisper/assets/gpt2.tiktoken")
    out.write_bytes(tar.extractfile(members[0]).read())
EOF

actual_sha256="$(sha256_of "$partial")"
if [[ "$actual_sha256" != "$expected_sha256" ]]; then
    rm -f "$partial"
    echo "provision_bpe: extracted file has sha256 $actual_sha256, expected $expected_sha256" >&2
    exit 1
fi
mv -f "$partial" "$dest"
echo "provision_bpe: wrote $dest (sha256 ok); export JAXGPT_BPE_FILE=$dest"
