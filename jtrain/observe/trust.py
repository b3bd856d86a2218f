"""Whether a run's config.json may name code: the run trust rule.

A config names code by import path ("package.module:function": model.factory,
step.factory, data.source, data.transform, data.valid_fn, loss.fn, loss.terms.*.fn,
eval.predict_fn, data.mixture.*.source), and the commands that rebuild a run from its
config.json (jtrain evaluate, jtrain replay, python -m jtrain.recipes.report) import
those modules and call them with kwargs from the same file. A run directory is data,
so (as Jupyter trusts notebooks) the user's own tools sign what they write:

- when jtrain writes a run's config.json it writes config.json.sig beside it: the
  HMAC-SHA256 of the file's bytes under a per-user key (`key_file()`: $JTRAIN_TRUST_KEY_FILE,
  else $XDG_CONFIG_HOME/jtrain/trust.key, else ~/.config/jtrain/trust.key; created 0600
  on first use);
- a command that opens a run whose config.json names code outside jtrain's own package
  refuses, before importing anything, unless the signature verifies with the user's key:
  one WorkdirError naming each import path and `jtrain trust RUN`, which signs it.

Paths into jtrain itself ("jtrain.module:function", a function jtrain defines) need no
signature.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets

from jtrain.errors import WorkdirError
from jtrain.observe import layout, runfiles

KEY_ENV = "JTRAIN_TRUST_KEY_FILE"
SIGNATURE_FILE = "config.json.sig"
_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def key_file() -> str:
    """Where the user's key lives (see the module docstring)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"),
                                                              ".config")
    return os.path.join(base, "jtrain", "trust.key")


def user_key(create: bool = True) -> bytes | None:
    """The user's key; created (32 random bytes, hex, mode 0600) when missing and
    `create`; None when missing and not `create`."""
    path = key_file()
    try:
        with open(path, "rb") as f:
            return f.read().strip()
    except FileNotFoundError:
        if not create:
            return None
    except OSError as e:
        raise WorkdirError(path, f"cannot read the trust key ({e.strerror}); set "
                           f"{KEY_ENV}=FILE to keep it elsewhere") from None
    key = secrets.token_hex(32).encode()
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another process made it first: use that one
        return user_key(create=False)
    except OSError as e:
        raise WorkdirError(path, f"cannot create the trust key ({e.strerror}); set "
                           f"{KEY_ENV}=FILE to keep it elsewhere") from None
    with os.fdopen(fd, "wb") as f:
        f.write(key + b"\n")
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
    """Every (import path, dotted key) a config dict names: the string values shaped
    "package.module:attribute", wherever they are (kwargs included)."""
    found: list[tuple[str, str]] = []
    items = (config.items() if isinstance(config, dict)
             else enumerate(config) if isinstance(config, (list, tuple)) else ())
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, str) and _PATH.fullmatch(v):
            found.append((v, key))
        elif isinstance(v, (dict, list, tuple)):
            found.extend(import_paths(v, key + "."))
    return found


def is_jtrains(path: str) -> bool:
    """True for "jtrain.module:function" naming a function jtrain itself defines there
    (not a name it imported, e.g. jtrain.x:os.system); importing jtrain's own module is
    safe."""
    import importlib

    module_name, attr = path.split(":", 1)
    if not module_name.startswith("jtrain.") or "." in attr:
        return False
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception:
        return False  # its own error comes when the command imports it
    return str(getattr(obj, "__module__", "")).startswith("jtrain.")


def untrusted(config: dict, skip=()) -> list[tuple[str, str]]:
    """The (path, key) pairs of a config that need the user's trust; keys under a prefix
    in `skip` are not imported by the caller (a model passed from Python: "model.")."""
    return [(p, k) for p, k in import_paths(config)
            if not any(k.startswith(s) for s in skip) and not is_jtrains(p)]


def verify(workdir: str) -> bool:
    """Whether config.json.sig is the user's signature of config.json as it is."""
    try:  # bytes: a signature that is not ASCII hex simply does not match
        content = runfiles.read_bytes(os.path.join(workdir, "config.json"))
        sig = runfiles.read_bytes(os.path.join(workdir, SIGNATURE_FILE),
                                  runfiles.SIGNATURE).strip()
    except (OSError, WorkdirError):
        return False
    try:
        key = user_key(create=False)
    except WorkdirError:
        return False
    return key is not None and hmac.compare_digest(signature(content, key).encode(), sig)


def listing(paths) -> str:
    return ", ".join(f"{p} ({k})" for p, k in paths)


def check(workdir: str, config: dict, *, skip=(), shown: str | None = None) -> None:
    """A WorkdirError unless every import path the run's config names is jtrain's own or
    the user signed its config.json; before anything is imported. `shown`: the run as
    the user named it (in the line)."""
    paths = untrusted(config, skip)
    if not paths or verify(workdir):
        return
    shown = shown or workdir
    raise WorkdirError(os.path.join(shown, "config.json"),
                       f"names code that runs when it is opened: {listing(paths)}; if you "
                       f"trust it: jtrain trust {shown}")
