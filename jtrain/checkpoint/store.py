"""Run directories on object storage (`s3://bucket/run`, `gs://bucket/run`) through fsspec,
and `check_workdir`: whether a local path or a URI can be a run's directory (light: the
train command calls it before the engine's imports). docs/guide/object-storage.md.

jtrain writes a run with local file I/O, so a bucket workdir is a local staging copy
mirrored by `Mirror`: `pull` brings the run's files and each checkpoint step carrying
the commit marker (a key landing outside the copy refuses the run in one line; a step
without the marker is a torn upload, never restored); `commit_step` uploads a finished
step's files, then the marker `COMMIT` (from the Checkpointer's finalization hook, in
the save thread); `push` uploads the other files that changed and deletes the steps the
keep policy dropped (marker first). `skip` leaves top-level folders out (a search's
trials mirror themselves); `committed(uri)` and `read_bytes(uri)` read a bucket run
without a staging copy.

Credentials come from the environment and the provider's standard chain only; a URI
with credentials in it is refused (masked); an unreachable bucket is one WorkdirError
naming the URI. JTRAIN_STAGING_DIR (set by --verify_resume) names the staging copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading

from jtrain import paths
from jtrain.errors import JtrainError, WorkdirError, first_line
from jtrain.redact import redact_text

COMMIT = "jtrain_committed.json"
STAGING_ENV = "JTRAIN_STAGING_DIR"
CHECKPOINTS = "checkpoints"
# scheme -> (fsspec protocol, the package that implements it, the extra that installs it)
SCHEMES = {"s3": ("s3", "s3fs", "pip install 'jtrain[s3]'"),
           "gs": ("gcs", "gcsfs", "pip install gcsfs")}
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)(/.*)?$")
_STEP = re.compile(r"^[0-9]+$")


def is_remote(path) -> bool:
    """Whether `path` is a URI (scheme://...) rather than a local path."""
    return isinstance(path, str) and _URI.match(path) is not None


def join(root: str, rel: str) -> str:
    """`rel` under `root`, a local path or a URI (s3://bucket/run + metrics.jsonl ->
    s3://bucket/run/metrics.jsonl)."""
    return f"{root.rstrip('/')}/{rel}" if is_remote(root) else os.path.join(root, rel)


def split(uri: str) -> tuple[str, str]:
    """(scheme, "bucket/prefix") of a supported URI; else one WorkdirError naming it."""
    m = _URI.match(uri)
    if m is None:
        raise WorkdirError(uri, "not a URI (scheme://bucket/path)")
    scheme, bucket, rest = m.group(1).lower(), m.group(2), (m.group(3) or "").strip("/")
    if "@" in bucket:
        raise WorkdirError(redact_text(uri), "credentials in the URI are refused: jtrain "
                           "takes them from the environment or the provider's standard "
                           "chain (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    if scheme not in SCHEMES:
        raise WorkdirError(uri, f"{scheme}:// is not a supported store (supported: "
                           f"{', '.join(s + '://' for s in SCHEMES)}; else a local or "
                           "mounted path)")
    if not bucket:
        raise WorkdirError(uri, "names no bucket")
    return scheme, f"{bucket}/{rest}" if rest else bucket


def filesystem(uri: str, *, quick: bool = False):
    """The fsspec filesystem of `uri`'s scheme. `quick`: one attempt per request (the
    start-up check: an unreachable endpoint is one line within seconds, not retried)."""
    scheme, _ = split(uri)
    protocol, package, install = SCHEMES[scheme]
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError:
        raise WorkdirError(uri, f"{scheme}:// needs the {package} package ({install})") \
            from None
    kwargs: dict = {"skip_instance_cache": True}
    if quick and scheme == "s3":
        kwargs.update(config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 10})
    fs = cls(**kwargs)
    if quick and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop around botocore's
    return fs


def failure(uri: str, e: BaseException, doing: str = "") -> WorkdirError:
    """One WorkdirError naming `uri` for a storage client's exception."""
    text = f"{type(e).__name__} {e}"
    doing = f" ({doing})" if doing else ""
    if isinstance(e, PermissionError) or re.search(
            r"AccessDenied|Forbidden|InvalidAccessKeyId|SignatureDoesNotMatch|"
            r"NoCredentials|Unable to locate credentials|\b40[13]\b", text):
        why = ("access denied: check the credentials in the environment (e.g. "
               "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and the "
               "bucket's permissions")
    elif re.search(r"bucket does not exist|NoSuchBucket", text):
        why = "no such bucket"
    elif re.search(r"[Cc]onnect|[Ee]ndpoint|[Tt]imeout|[Tt]imed out|resolve", text):
        why = (f"cannot reach the object store ({first_line(e)[:200]}); check the "
               "network and AWS_ENDPOINT_URL")
    else:
        why = f"{type(e).__name__}: {first_line(e)[:200]}"
    return WorkdirError(redact_text(uri), why + doing)


def check(uri: str) -> None:
    """The start-up check of a workdir URI: supported, its package installed, its bucket
    reachable and readable with the environment's credentials (one attempt each)."""
    _, root = split(uri)
    fs = filesystem(uri, quick=True)
    try:
        fs.ls(root.split("/", 1)[0], refresh=True)
    except Exception as e:
        raise failure(uri, e) from None


def _files(top: str, skip=()) -> dict[str, os.stat_result]:
    """{relative path: stat} of the regular files under `top` (no links followed)."""
    out = {}
    for d, dirs, names in os.walk(top):
        rel_d = os.path.relpath(d, top)
        if rel_d == ".":
            dirs[:] = [x for x in dirs if x not in skip]
        for n in names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if os.path.isfile(p) and not os.path.islink(p) and not n.endswith(".tmp"):
                out[os.path.normpath(os.path.join(rel_d, n))] = st
    return out


def _listing(uri: str, fs, root: str, skip=()) -> tuple[list[int], list[int],
                                                        dict[str, list[str]]]:
    """(committed steps, torn steps, {"checkpoints/N" or "": [rel files]}) under `root`;
    files under a top-level folder named in `skip` are left out."""
    try:
        found = fs.find(root, detail=False)
    except Exception as e:
        raise failure(uri, e, "listing") from None
    by_step: dict[str, list[str]] = {}
    for path in found:
        rel = path[len(root) + 1:] if path.startswith(root + "/") else None
        if not rel:
            continue
        parts = rel.split("/")
        if len(parts) > 1 and parts[0] in skip:
            continue
        key = "/".join(parts[:2]) if parts[0] == CHECKPOINTS and len(parts) > 2 else ""
        by_step.setdefault(key, []).append(rel)
    committed, torn = [], []
    for key, rels in by_step.items():
        if not key:
            continue
        name = key.split("/")[1]
        if not _STEP.match(name):
            continue
        (committed if f"{key}/{COMMIT}" in rels else torn).append(int(name))
    return sorted(committed), sorted(torn), by_step


def committed(uri: str) -> list[int]:
    """The committed checkpoint steps of the run at `uri` (what a restart restores from:
    the newest of them), read from the bucket; [] when it holds none."""
    _, root = split(uri.rstrip("/"))
    return _listing(uri, filesystem(uri), root)[0]


def read_bytes(uri: str) -> bytes | None:
    """The object at `uri` (e.g. a run's metrics.jsonl), or None when there is none."""
    _, path = split(uri)
    fs = filesystem(uri)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None
    except Exception as e:
        raise failure(uri, e, "reading") from None


class Mirror:
    """A run directory at `uri` and its local staging copy (`self.local`).

    `owner`: the training run, the one writer: it deletes torn uploads and the steps its
    keep policy dropped. A reader (evaluate, export, diff, replay) deletes nothing.
    `skip`: top-level folders neither pulled nor pushed (a search's trials: each trial
    is a run of its own, mirrored by its own training run)."""

    def __init__(self, uri: str, *, owner: bool, say=None, skip: tuple[str, ...] = ()):
        self.uri = uri.rstrip("/")
        self.scheme, self.root = split(self.uri)
        self.owner, self._say = owner, say or (lambda line: None)
        self.skip = tuple(skip)
        self.fs = filesystem(self.uri)
        staging = os.environ.get(STAGING_ENV) if owner else None
        if staging:  # --verify_resume's: a path it watches
            os.makedirs(staging, exist_ok=True)
        self.local = staging or tempfile.mkdtemp(prefix="jtrain-run-")
        self._pushed: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) uploaded
        self._steps: set[int] = set()  # committed steps the local copy holds (or held)
        self._lock = threading.Lock()
        self.found = False  # pull found something under the prefix

    def _remote(self, rel: str) -> str:
        return f"{self.root}/{rel.replace(os.sep, '/')}"

    def _call(self, doing: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except WorkdirError:
            raise
        except Exception as e:
            raise failure(self.uri, e, doing) from None

    # -- reading ------------------------------------------------------------------------
    def committed_steps(self) -> tuple[list[int], list[int], dict[str, list[str]]]:
        """(committed steps, torn steps, {rel dir: [rel files]}) in the bucket (the files
        of `skip`'s folders left out)."""
        return _listing(self.uri, self.fs, self.root, self.skip)

    def pull(self) -> list[int]:
        """The bucket's run into the staging copy; returns the committed steps fetched."""
        committed, torn, by_step = self.committed_steps()
        for step in torn:
            if self.owner:
                self._say(f"warning: {self.uri}/{CHECKPOINTS}/{step}: an unfinished upload "
                          "(no commit marker); removed")
                self._call("deleting a torn upload", self.fs.rm,
                           self._remote(f"{CHECKPOINTS}/{step}"), recursive=True)
        rels = list(by_step.get("", []))
        for step in committed:
            rels += [r for r in by_step[f"{CHECKPOINTS}/{step}"]
                     if not r.endswith("/" + COMMIT)]
        rels = [r for r in rels if not r.endswith("/")]  # folder markers: no content
        # A key is foreign data: each becomes a path inside the staging copy or the
        # whole run is refused, before anything is downloaded.
        locals_ = [paths.confined(self.local, r, f"{redact_text(self.uri)}: key {r!r}")
                   for r in rels]
        if rels:
            for p in locals_:
                os.makedirs(os.path.dirname(p), exist_ok=True)
            self._call("downloading", self.fs.get, [self._remote(r) for r in rels],
                       locals_)
        self.found = bool(by_step)
        self._pushed = {rel: (st.st_size, st.st_mtime_ns) for rel, st in
                        _files(self.local, skip=(CHECKPOINTS, *self.skip)).items()}
        self._steps = set(committed)
        return committed

    # -- writing ------------------------------------------------------------------------
    def commit_step(self, step: int, directory: str) -> None:
        """Uploads a finished step's files from `directory`, then its commit marker."""
        files = sorted(_files(directory))
        prefix = f"{CHECKPOINTS}/{step}"
        with self._lock:
            self._call(f"uploading checkpoint step {step}", self.fs.put,
                       [os.path.join(directory, r) for r in files],
                       [self._remote(f"{prefix}/{r}") for r in files])
            self._call(f"committing checkpoint step {step}", self.fs.pipe,
                       self._remote(f"{prefix}/{COMMIT}"),
                       json.dumps({"step": step, "files": len(files)}).encode())
            self._steps.add(step)

    def upload(self, rel: str) -> None:
        """Uploads one file of the staging copy now (a record that must reach the bucket
        before the process may die, e.g. WORKDIR/faults.jsonl)."""
        path = os.path.join(self.local, rel)
        st = os.stat(path)
        self._call("uploading", self.fs.put_file, path, self._remote(rel))
        self._pushed[rel] = (st.st_size, st.st_mtime_ns)

    def push(self) -> None:
        """Uploads the run's changed files; deletes in the bucket the steps no longer kept
        locally (owner only)."""
        changed = [(rel, (st.st_size, st.st_mtime_ns)) for rel, st in
                   _files(self.local, skip=(CHECKPOINTS, *self.skip)).items()
                   if self._pushed.get(rel) != (st.st_size, st.st_mtime_ns)]
        if changed:
            self._call("uploading", self.fs.put,
                       [os.path.join(self.local, r) for r, _ in changed],
                       [self._remote(r) for r, _ in changed])
            self._pushed.update(changed)
        if not self.owner:
            return
        with self._lock:
            directory = os.path.join(self.local, CHECKPOINTS)
            kept = {int(n) for n in (os.listdir(directory) if os.path.isdir(directory)
                                     else ()) if _STEP.match(n)}
            for step in sorted(self._steps - kept):  # dropped by the keep policy / damaged
                prefix = self._remote(f"{CHECKPOINTS}/{step}")
                self._call(f"deleting checkpoint step {step}", self.fs.rm,
                           f"{prefix}/{COMMIT}")
                self._call(f"deleting checkpoint step {step}", self.fs.rm, prefix,
                           recursive=True)
                self._steps.discard(step)

    def close(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)


@contextlib.contextmanager
def local_copy(path: str, *, write_back: bool = False, pull: bool = True, say=None):
    """`path` itself when local; for a URI, a staging copy of the run (pulled, read-only
    in the bucket) removed afterwards. `write_back`: files the command added or changed
    (e.g. an evaluation report) are uploaded when it succeeds. `pull=False`: an empty
    directory (an output, e.g. export --out=s3://...), uploaded when it succeeds."""
    if not is_remote(path):
        yield path
        return
    mirror = Mirror(path, owner=False, say=say)
    try:
        if pull:
            mirror.pull()
            if not mirror.found:
                raise WorkdirError(mirror.uri, "holds no run (nothing under that prefix)")
        try:
            yield mirror.local
        except JtrainError as e:  # named by its URI, not by the staging copy
            if mirror.local not in str(e):
                raise
            raise type(e)(str(e).replace(mirror.local, mirror.uri)) from None
        if write_back or not pull:
            mirror.push()
    finally:
        mirror.close()


def check_workdir(path: str) -> None:
    """A WorkdirError naming the workdir when it cannot be a run's directory: an
    object-store URI that is not supported or cannot be reached, a file, or not
    writable. Writing is tried (a file created and removed in the workdir, or in its
    nearest existing parent when it does not exist yet), not inferred from permission
    bits: root passes every os.access check, and a read-only file system fails only the
    write."""
    if is_remote(path):  # s3:// or gs://: reachable and readable, else one line
        check(path)
        return
    path = parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the nearest existing ancestor must be writable
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        where = "" if parent == path else f" (in {path})"
        raise WorkdirError(f"{parent} is a file, not a directory{where}; choose another "
                           "--workdir")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        why = (e.strerror or str(e)).lower()
        raise WorkdirError(f"{parent} is not writable ({why}): the run writes its "
                           "checkpoints and logs there; choose another --workdir") from None
