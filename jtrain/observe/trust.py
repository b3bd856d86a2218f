"""Whether a run's config.json may name code: the run trust rule.

A config names code by import path ("package.module:function": model.factory,
step.factory, data.source, data.transform, data.valid_fn, loss.fn, loss.terms.*.fn,
eval.predict_fn, data.mixture.*.source, control.callbacks), and the commands that
rebuild a run from its config.json (jtrain evaluate, jtrain replay, python -m
jtrain.recipes.report; jtrain sample, its model.factory only) import those modules and
call them with kwargs from the same file. A run directory is data, so (as Jupyter
trusts notebooks) the user's own tools sign what they write:

- when jtrain writes a run's config.json it writes config.json.sig beside it: the
  HMAC-SHA256 of the file's bytes under a per-user key (`key_file()`: $JTRAIN_TRUST_KEY_FILE,
  else $XDG_CONFIG_HOME/jtrain/trust.key, else ~/.config/jtrain/trust.key; created 0600
  on first use);
- a command that opens a run whose config.json names code not on the list UNSIGNED below
  refuses, before importing anything, unless the signature verifies with the user's key:
  one WorkdirError naming each import path and `jtrain trust RUN`, which signs it.

What a config may name without a signature is the explicit list UNSIGNED below: the
recipe factories the configs in configs/recipes/ name and the benchmark's data source,
each a pure builder of a model, data, a loss, a predict function or a step. Being
defined in jtrain is not enough (jtrain also defines functions that spawn processes,
run commands, write or delete files); any other name needs the signature, whatever its
shape: at a key that only names code (CODE_KEYS) every string is a name, colon or not.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat

from jtrain.errors import WorkdirError
from jtrain.observe import layout, runfiles

KEY_ENV = "JTRAIN_TRUST_KEY_FILE"
SIGNATURE_FILE = "config.json.sig"
_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

# The keys whose value is only ever an import path: any string there is a name to check
# (a module path without ":" is imported too, e.g. by python -m jtrain.recipes.report).
CODE_KEYS = frozenset({"model.factory", "step.factory", "data.source", "data.transform",
                       "data.valid_fn", "loss.fn", "eval.predict_fn", "control.callbacks"})
# Keys that hold a built-in's name or an import path (with ":"): loss.terms.NAME.fn,
# data.mixture.NAME.source.
_BUILTIN_OR_CODE = re.compile(r"loss\.terms\.[^.]+\.fn|data\.mixture\.[^.]+\.source")

# What a config may name unsigned, and what each is: functions that only build a model,
# data, a loss, a predict function or a step from their kwargs (no process, no file
# written, moved or deleted). docs/guide/forensics.md lists exactly these
# (tests/checkpoint/test_run_trust.py checks both).
UNSIGNED: dict[str, str] = {
    "jtrain.recipes.autoencoder:make_model": "model of recipes/multiloss_autoencoder.py",
    "jtrain.recipes.autoencoder:make_data": "data of recipes/multiloss_autoencoder.py",
    "jtrain.recipes.autoencoder:latent": "predict_fn of recipes/multiloss_autoencoder.py",
    "jtrain.recipes.byol:make": "step of recipes/byol.py",
    "jtrain.recipes.byol:make_data": "data of recipes/byol.py",
    "jtrain.recipes.byol:eval_loss": "loss of recipes/byol.py",
    "jtrain.recipes.classify:make_data": "data of recipes/classify.py",
    "jtrain.recipes.distill:make": "step of recipes/distill.py",
    "jtrain.recipes.dpo:make": "step of recipes/dpo.py",
    "jtrain.recipes.dpo:make_data": "data of recipes/dpo.py",
    "jtrain.recipes.dpo:eval_loss": "loss of recipes/dpo.py",
    "jtrain.recipes.gan:make": "step of recipes/gan.py",
    "jtrain.recipes.gan:make_data": "data of recipes/gan.py",
    "jtrain.recipes.gan:eval_loss": "loss of recipes/gan.py",
    "jtrain.recipes.imputation:make_model": "model of recipes/imputation.py",
    "jtrain.recipes.imputation:make_data": "data of recipes/imputation.py",
    "jtrain.recipes.imputation:loss": "loss of recipes/imputation.py",
    "jtrain.recipes.imputation:predict": "predict_fn of recipes/imputation.py",
    "jtrain.recipes.pretrain:make_pretrain_model": "model of recipes/masked_pretrain.py",
    "jtrain.recipes.pretrain:make_pretrain_data": "data of recipes/masked_pretrain.py",
    "jtrain.recipes.pretrain:mlm_loss": "loss of recipes/masked_pretrain.py",
    "jtrain.recipes.pretrain:mlm_predict": "predict_fn of recipes/masked_pretrain.py",
    "jtrain.recipes.pretrain:make_classifier": "model of recipes/finetune.py",
    "jtrain.recipes.pretrain:make_finetune_data": "data of recipes/finetune.py",
    "jtrain.recipes.sam:make": "step of recipes/sam.py",
    "jtrain.recipes.sam:make_data": "data of recipes/sam.py",
    "jtrain.recipes.set_completion:make_model": "model of recipes/set_completion.py",
    "jtrain.recipes.set_completion:make_data": "data of recipes/set_completion.py",
    "jtrain.recipes.set_completion:loss": "loss of recipes/set_completion.py",
    "jtrain.bench.digits:digits": "data of jtrain bench peers' mlp case",
}


def key_file() -> str:
    """Where the user's key lives (see the module docstring)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"),
                                                              ".config")
    return os.path.join(base, "jtrain", "trust.key")


MIN_KEY_BYTES = 32  # the key made here is 64 hex digits; a shorter one is guessable


def user_key(create: bool = True) -> bytes | None:
    """The user's key; created (32 random bytes, hex, mode 0600) when missing and
    `create`; None when missing and not `create`. A key anyone else could read or
    replace signs nothing (as ssh refuses such a private key): one WorkdirError saying
    how to fix it."""
    path = key_file()
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    key = secrets.token_hex(32).encode()
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key + b"\n")
        # linked whole into place: a reader never sees a half-written key
        os.link(tmp, path)
    except FileExistsError:  # another process made it first: use that one
        return user_key(create=False)
    except OSError as e:
        raise WorkdirError(path, f"cannot create the trust key ({e.strerror}); set "
                           f"{KEY_ENV}=FILE to keep it elsewhere") from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
    return key


def _read_key(path: str) -> bytes:
    """The key at `path` once it is the user's own regular file, private and long enough;
    FileNotFoundError when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as e:
        if os.path.islink(path):
            raise WorkdirError(path, "the trust key is a symbolic link; put the key file "
                                     f"itself there (or set {KEY_ENV}=FILE)") from None
        raise WorkdirError(path, f"cannot read the trust key ({e.strerror}); set "
                                 f"{KEY_ENV}=FILE to keep it elsewhere") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkdirError(path, "the trust key is not a regular file; remove it and "
                                     "a new one is made")
        if st.st_uid != os.getuid():
            raise WorkdirError(path, f"the trust key belongs to uid {st.st_uid}, not to you "
                                     f"(uid {os.getuid()}); remove it and a new one is made")
        if st.st_mode & 0o077:
            raise WorkdirError(path, f"the trust key is open to others (mode "
                                     f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}")
        key = f.read().strip()
    if len(key) < MIN_KEY_BYTES:
        raise WorkdirError(path, f"the trust key is {len(key)} bytes, under "
                                 f"{MIN_KEY_BYTES}; remove it and a new one is made")
    return key


def signature(content: bytes, key: bytes) -> str:
    return hmac.new(key, content, hashlib.sha256).hexdigest()


def sign(workdir: str, *, required: bool = True) -> str | None:
    """Signs the workdir's config.json as it is now with the user's key (config.json.sig);
    returns the signature. Not `required` (training): without a usable key file the run
    is left unsigned (None; `jtrain trust` says why)."""
    try:
        key = user_key()
    except WorkdirError:
        if required:
            raise
        return None
    if key is None:
        return None
    sig = signature(runfiles.read_bytes(os.path.join(workdir, "config.json")), key)
    layout.write_file(os.path.join(workdir, SIGNATURE_FILE), sig + "\n")
    return sig


def import_paths(config, prefix: str = "") -> list[tuple[str, str]]:
    """Every (name, dotted key) a config dict names as code: any string at a CODE_KEYS
    key, a string with ":" at loss.terms.*.fn or data.mixture.*.source, and anywhere
    else (kwargs included) the strings shaped "package.module:attribute"."""
    found: list[tuple[str, str]] = []
    items = (config.items() if isinstance(config, dict)
             else enumerate(config) if isinstance(config, (list, tuple)) else ())
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, str):
            if (key in CODE_KEYS and v) or _PATH.fullmatch(v) or (
                    prefix.rstrip(".") in CODE_KEYS and v) or (
                    ":" in v and _BUILTIN_OR_CODE.fullmatch(key)):
                found.append((v, key))
        elif isinstance(v, (dict, list, tuple)):
            found.extend(import_paths(v, key + "."))
    return found


def untrusted(config: dict, skip=()) -> list[tuple[str, str]]:
    """The (path, key) pairs of a config that need the user's trust; keys under a prefix
    in `skip` are not imported by the caller (a model passed from Python: "model.")."""
    return [(p, k) for p, k in import_paths(config)
            if not any(k.startswith(s) for s in skip) and p not in UNSIGNED]


def verify(workdir: str, *, strict: bool = False) -> bool:
    """Whether config.json.sig is the user's signature of config.json as it is; `strict`:
    a key that signs nothing (user_key) raises its WorkdirError instead of False."""
    try:  # bytes: a signature that is not ASCII hex simply does not match
        content = runfiles.read_bytes(os.path.join(workdir, "config.json"))
        sig = runfiles.read_bytes(os.path.join(workdir, SIGNATURE_FILE),
                                  runfiles.SIGNATURE).strip()
    except (OSError, WorkdirError):
        return False
    try:
        key = user_key(create=False)
    except WorkdirError:
        if strict:
            raise
        return False
    return key is not None and hmac.compare_digest(signature(content, key).encode(), sig)


def listing(paths) -> str:
    return ", ".join(f"{p} ({k})" for p, k in paths)


def check(workdir: str, config: dict, *, skip=(), shown: str | None = None) -> None:
    """A WorkdirError unless every import path the run's config names is in UNSIGNED or
    the user signed its config.json; before anything is imported. `shown`: the run as
    the user named it (in the line)."""
    paths = untrusted(config, skip)
    if not paths or verify(workdir, strict=True):
        return
    shown = shown or workdir
    raise WorkdirError(os.path.join(shown, "config.json"),
                       f"names code that runs when it is opened: {listing(paths)}; if you "
                       f"trust it: jtrain trust {shown}")
