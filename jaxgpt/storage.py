"""Where files live: a local directory, or a bucket (`gs://BUCKET/PATH`, `s3://BUCKET/PATH`).

Work directories, datasets and exports all take their location from `location()`: a `pathlib.Path` for a
local path (as before), an `etils.epath.Path` for a bucket URL, whose files gcsfs / s3fs read and write.
Orbax takes either as its directory; its tensorstore writer then talks to the bucket itself, each host
writing its own shards, so a checkpoint never passes through a shared file system.

An object store has no rename and no append, which changes what is atomic:
* one object PUT is: `write_text` replaces a small file (config.json, a lease) in one request;
* a checkpoint is committed by the `commit_success.txt` orbax writes after all its files (its COMMIT_FILE
  mode), not by renaming a directory, so a save killed half-way is never taken for a checkpoint;
* files that grow (metrics.jsonl, TensorBoard events) are written locally and uploaded whole (`Mirror`);
* a dataset or an export is uploaded file by file with its `meta.json` / `config.json` last.

Endpoints and credentials come from each cloud's own settings: Application Default Credentials for GCS,
the AWS variables or ~/.aws for S3; STORAGE_EMULATOR_HOST points GCS clients at another server and
AWS_ENDPOINT_URL does the same for S3 (the tests start both servers on 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from etils import epath

from jaxgpt.errors import StorageError, UserError, optional_import

# scheme -> the fsspec package that reads and writes it
SCHEMES = {"gs": "gcsfs", "s3": "s3fs"}
Location = Path | epath.Path  # what `location` returns
# What a setting that names a place takes (`check`): a local path or a bucket URL; a local path only (a file
# read or written with plain file calls: a ranks file, a text file, a PNG); or a weight source
# (`jaxgpt.io.weights`: workdir:LOCATION, hf:LOCATION, preset:NAME), whose location follows its kind.
ANYWHERE, LOCAL, SOURCE = "anywhere", "local", "source"


def is_bucket(where: str | os.PathLike[str]) -> bool:
    return str(where).startswith(tuple(f"{s}://" for s in SCHEMES))


def location(text: str | os.PathLike[str], flag: str, buckets: bool = True, *, given: str | None = None) -> Location:
    """The place `text` names: an absolute local path, or a bucket URL (checked, its client configured).

    `flag` is the setting that gave it (e.g. --config.workdir) and `given` its whole value when `text` is part
    of it, for the one-line errors. Any other URL is refused rather than taken for a relative path
    (`ftp://host/x` would be the directory `ftp:/host/x`), and so is a bucket URL where `buckets` is False: a
    file that only plain file calls read or write.
    """
    text = os.fspath(text)
    if "://" not in text:
        return Path(text).expanduser().absolute()
    scheme, _, rest = text.partition("://")
    setting = f"{flag}={given or text}"
    if not buckets:
        raise UserError(f"{setting} is a URL, but {flag} takes a local path: copy the file to this machine and pass "
                        "its path")
    if scheme not in SCHEMES:
        raise UserError(f"{setting}: {scheme}:// is not a supported location: use a local path, gs://BUCKET/PATH or "
                        "s3://BUCKET/PATH")
    if not rest.strip("/"):
        raise UserError(f"{setting} names no bucket: use {scheme}://BUCKET/PATH")
    optional_import(SCHEMES[scheme], setting, otherwise="use a local path")
    _configure()
    return epath.Path(f"{scheme}://{rest.rstrip('/')}")


def check(text: str | os.PathLike[str], flag: str, kind: str = ANYWHERE) -> None:
    """Refuse a place that setting `flag` cannot use (`kind`: ANYWHERE, LOCAL or SOURCE), before any work:
    one line naming `flag`, where a URL no client reads would otherwise become a local directory named after
    its scheme ("ftp:"), or fail late with a traceback from the library that got it."""
    text = os.fspath(text)
    location(text.partition(":")[2] if kind == SOURCE else text, flag, buckets=kind != LOCAL, given=text)


@functools.cache
def _configure() -> None:
    """Give tensorstore (orbax's writer) the endpoints the fsspec clients already use, and teach orbax s3://."""
    import fsspec

    # A listing is read fresh (another process or host may have written), and a request that gets no answer
    # (a network partition drops packets rather than refusing them) fails after a while instead of never.
    for protocol in ("gcs", "gs"):
        fsspec.config.conf.setdefault(protocol, {}).update(use_listings_cache=False, requests_timeout=30)
    fsspec.config.conf.setdefault("s3", {}).update(
        use_listings_cache=False, config_kwargs={"connect_timeout": 10, "read_timeout": 30})
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", os.environ["STORAGE_EMULATOR_HOST"])
    # gcsfs logs each failed request with a traceback; `guard` reports the failure once, as one line.
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    from orbax.checkpoint._src.serialization import tensorstore_utils

    # tensorstore retries a failing request up to 32 times, backing off to 32 s: a server that went away would
    # hold the run for a quarter of an hour. These bound it to about a minute (JAXGPT_STORAGE_RETRIES).
    retries = {"max_retries": int(os.environ.get("JAXGPT_STORAGE_RETRIES", "8")), "initial_delay": "1s",
               "max_delay": "16s"}
    for context in (tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT, tensorstore_utils._BASE_TS_CONTEXT):
        context.update(gcs_request_retries=retries, s3_request_retries=retries)
    build = tensorstore_utils.build_kvstore_tspec
    if getattr(build, "jaxgpt_s3", False):
        return

    def build_with_s3(directory: Any, *args: Any, **kwargs: Any) -> Any:
        # orbax 0.12 builds tensorstore specs for gs:// and local paths only; an s3:// spec is the gs:// one with
        # tensorstore's s3 driver in place of its gcs driver (same bucket/path members).
        if not str(directory).startswith("s3://"):
            return build(directory, *args, **kwargs)
        return _gcs_to_s3(build("gs://" + str(directory)[5:], *args, **kwargs))

    build_with_s3.jaxgpt_s3 = True  # type: ignore[attr-defined]
    tensorstore_utils.build_kvstore_tspec = build_with_s3


def _gcs_to_s3(spec: Any) -> Any:
    if isinstance(spec, dict):
        if spec.get("driver") == "gcs":
            s3 = {**spec, "driver": "s3"}
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            return s3 | ({"endpoint": endpoint} if endpoint else {}) | ({"aws_region": region} if region else {})
        return {k: _gcs_to_s3(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_gcs_to_s3(v) for v in spec]
    return spec


# What a storage failure's messages contain, by what the user has to do about it (checked in this order: a
# server that cannot be reached says nothing reliable about permissions). Status codes only as whole words, so
# that a port or a hash that contains the digits does not count.
_CAUSES = (
    ("the storage server cannot be reached", r"Connection refused|Cannot connect|ConnectionRefused|"
                                             r"EndpointConnectionError|ClientConnectorError|\bUNAVAILABLE\b|"
                                             r"Could not connect|Connect call failed|Connection reset|"
                                             r"ServerDisconnected|timed out|DEADLINE_EXCEEDED|Failed to connect"),
    ("no credentials", r"credentials|NoCredentialsError|\b401\b|Unauthorized|InvalidAccessKeyId|"
                       r"SignatureDoesNotMatch"),
    ("the bucket does not exist", r"NoSuchBucket|bucket does not exist|Bucket not found"),
    ("access denied", r"AccessDenied|Forbidden|\b403\b|PermissionError|Permission denied|PERMISSION_DENIED"),
)
_FIXES = {"no credentials": "set up credentials (docs/data.md: Runs in a bucket)",
          "the bucket does not exist": "create the bucket or fix the URL",
          "access denied": "grant this account write access to the bucket or choose another",
          "the storage server cannot be reached": "check the network or the endpoint setting, then run the same "
                                                  "command again"}


def _chain_text(error: BaseException) -> str:
    parts, seen, e = [], set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " | ".join(parts)


def failure(error: BaseException, url: str, doing: str) -> StorageError:
    """One line for a failed bucket operation: what was being done, on which URL, why, and the fix."""
    text = _chain_text(error)
    for cause, marks in _CAUSES:
        if re.search(marks, text):
            return StorageError(f"{doing} {url} failed: {cause}; {_FIXES[cause]}")
    if isinstance(error, FileNotFoundError) and not _bucket_exists(url):
        return StorageError(f"{doing} {url} failed: the bucket does not exist; {_FIXES['the bucket does not exist']}")
    return StorageError(f"{doing} {url} failed ({' '.join(text.split())[:200]})")


def _bucket_exists(url: str) -> bool:
    import fsspec

    scheme, _, rest = url.partition("://")
    try:
        return bool(fsspec.filesystem(scheme).exists(f"{scheme}://{rest.split('/')[0]}"))
    except Exception:  # unreachable too: not a missing bucket
        return True


@contextlib.contextmanager
def guard(where: Location, doing: str) -> Iterator[None]:
    """Turn a bucket client's exception into one line naming `where` (local paths keep their own errors)."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if not is_bucket(where):
            raise
        raise failure(e, str(where), doing) from None


def check_writable(where: Location, flag: str) -> None:
    """Create `where` and write (then delete) a probe file, before any expensive work starts."""
    probe = where / f".write-test-{os.getpid()}"
    if not is_bucket(where):
        try:
            where.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UserError(f"{where} is not writable ({e.strerror}): choose another {flag}") from None
        return
    with guard(where, "writing to"):
        probe.write_text("")
        probe.unlink()


def write_text(path: Location, text: str) -> None:
    """`write_bytes` of `text` in UTF-8."""
    write_bytes(path, text.encode())


def write_bytes(path: Location, data: bytes) -> None:
    """Replace `path` with `data` all at once: a crash or a full disk leaves the old file or the new one.

    In a bucket one PUT replaces an object atomically; on disk a temporary file is synced and renamed.
    """
    if is_bucket(path):
        with guard(path, "writing"):
            path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def move_dir(source: Location, target: Location) -> None:
    """Move a directory: a rename on disk; in a bucket, a copy of every object and then the deletes."""
    if not is_bucket(source):
        os.replace(source, target)
        return
    import fsspec

    with guard(source, "moving"):
        fs, path = fsspec.core.url_to_fs(str(source))
        fs.mv(path, fsspec.core.url_to_fs(str(target))[1], recursive=True)


def cache_root() -> Path:
    """Where jaxgpt keeps what it downloads or stages by itself: $JAXGPT_CACHE, default ~/.cache/jaxgpt. (The GPT-2
    ranks' default path and XLA's compilation cache have settings of their own: $JAXGPT_BPE_FILE,
    config.compilation_cache_dir.)"""
    return Path(os.environ.get("JAXGPT_CACHE") or Path.home() / ".cache" / "jaxgpt").expanduser()


def cache_dir(kind: str, url: str) -> Path:
    """A local directory for files of `url` under `cache_root`: one per URL and kind."""
    root = cache_root()
    name = url.split("://", 1)[-1].strip("/").replace("/", "_")[-60:]
    path = root / kind / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def names(where: Location, files_only: bool = False) -> list[str]:
    """The names directly in directory `where` (none when it does not exist: a bucket has no empty directories)."""
    with guard(where, "listing"):
        try:
            return sorted(p.name for p in where.iterdir() if not (files_only and p.is_dir()))
        except FileNotFoundError:  # (also when another host's probe, the only object, was just deleted)
            return []


def files(source: Location) -> list[str]:
    return names(source, files_only=True)


def stage(source: epath.Path, names: Sequence[str], sha256: dict[str, str] | None = None) -> Path:
    """A local copy of the files `names` of bucket directory `source`, downloaded once into the cache.

    A cached file is kept when it has the sha256 given for it (datasets record one per file), or else the
    bucket copy's size; a download goes to a temporary name and is renamed into place, so a kill leaves no
    half file for the next run to trust.
    """
    local = cache_dir("staged", str(source))
    sha256 = sha256 or {}
    for name in names:
        target = local / name
        if target.exists():
            if name in sha256:
                if sha256_file(target) == sha256[name]:
                    continue
            else:
                with guard(source, "reading"):
                    if (source / name).stat().length == target.stat().st_size:
                        continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        with guard(source, "reading"), (source / name).open("rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if name in sha256 and sha256_file(tmp) != sha256[name]:
            tmp.unlink()
            raise UserError(f"{source / name} does not match the sha256 its meta.json records (modified or corrupt "
                            "in the bucket): prepare the dataset again")
        os.replace(tmp, target)
    return local


def upload(local: Path, target: epath.Path, names: Sequence[str]) -> None:
    """Copy the files `names` of `local` to `target`, in that order (put the file that commits the rest last)."""
    with guard(target, "writing"):
        for name in names:  # (a bucket has no directories to make: an object's name is its whole path)
            with open(local / name, "rb") as src, (target / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)


def publish(local: Path, target: epath.Path, names: Sequence[str], commit: str) -> None:
    """Make bucket directory `target` hold the files `names` of `local`, `commit` among them: the file whose
    presence says the rest is complete (a dataset's meta.json, an export's config.json). An old `commit` is
    deleted first and the new one uploaded last, so a reader never takes a half-replaced directory for a whole
    one; files of the old contents that the new ones lack are deleted."""
    old = files(target)
    with guard(target, "writing"):
        for stale in sorted(set(old) - (set(names) - {commit}), key=lambda name: name != commit):
            (target / stale).unlink()
    upload(local, target, [name for name in names if name != commit] + [commit])


class Mirror:
    """A local copy of a bucket work directory's growing files, uploaded whole by `sync`.

    Objects cannot be appended to, so metrics.jsonl and TensorBoard's event files are written here and
    copied up when a checkpoint is saved and when the run ends (the rows after the last checkpoint are
    the ones a resume drops anyway); a file is uploaded again only when its size changed.
    """

    def __init__(self, workdir: epath.Path) -> None:
        self.workdir = workdir
        self.local = cache_dir("runs", str(workdir))
        shutil.rmtree(self.local)  # what an earlier run at this URL left here is not this run's
        self.local.mkdir()
        self._sizes: dict[str, int] = {}
        self.failed = False

    def fetch(self, name: str) -> Path:
        """`local/name`, replaced by the bucket's copy when there is one (the start of a resumed run)."""
        path = self.local / name
        with guard(self.workdir, "reading"):
            if (self.workdir / name).exists():
                path.write_bytes((self.workdir / name).read_bytes())
            else:
                path.unlink(missing_ok=True)
        return path

    def sync(self) -> None:
        """Upload what changed. After one failure (reported then) later calls do nothing: the run is ending,
        and each would wait out the client's retries again."""
        if self.failed:
            return
        changed = [str(p.relative_to(self.local)) for p in sorted(self.local.rglob("*")) if p.is_file()
                   and self._sizes.get(str(p.relative_to(self.local))) != p.stat().st_size]
        try:
            upload(self.local, self.workdir, changed)
        except StorageError:
            self.failed = True
            raise
        self._sizes |= {name: (self.local / name).stat().st_size for name in changed}


# Disk faults a user fixes by freeing space (or raising a quota / file-size limit).
DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def disk_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (its cause chain) if it is a full disk, quota or file-size limit."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e
        text = str(e)  # tensorstore (orbax's writer) reports the OS error inside its own message
        for code in DISK_FULL:
            if os.strerror(code) in text:
                return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


def free_bytes(path: Location) -> float:
    """Free space on the file system holding `path` (or its nearest existing parent); a bucket has no limit
    that can be read."""
    if is_bucket(path):
        return float("inf")
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
