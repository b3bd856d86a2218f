"""Redaction of secrets from everything jtrain prints or writes.

`redact(tree)` copies a config with values under secret-looking keys replaced;
`redact_text(s)` masks URI userinfo (passwords, tokens: everything between "://" and the
last "@"), the values of secret-named parameters (`?sig=...`, `&token=...`,
`--password=...`), secret environment values and secrets `redact` has seen. The console,
the log file, the metric writers and config.json all go through them.
"""

from __future__ import annotations

import os
import re
import threading

REDACTED = "<redacted>"

# Config keys whose (string or number) values are secrets. `token(?!s|iz)` keeps
# `max_tokens` and `tokenizer` readable; `*_key`, `apikey`, `private_key` etc. end in
# "key"; `auth(?!or(?!i))` takes auth, oauth, authorization but not author.
_SECRET_KEY = re.compile(
    r"(?:^|[_\-.]|api|access|private|secret|auth|client|master)key$"
    r"|token(?!s|iz)|passw(?:or)?d|passphrase|secret|credential|auth(?!or(?!i))",
    re.IGNORECASE,
)
_SECRET_ENV = re.compile(r"(?:^|_)KEY$|APIKEY|TOKEN(?!IZ)|PASSWORD|PASSWD|PASSPHRASE|SECRET"
                         r"|CREDENTIAL|(?:^|_)O?AUTH(?!OR(?!I)|_SOCK)", re.IGNORECASE)
# URI userinfo: everything between "://" and the last "@" of the URI is masked,
# scheme://user:pa/ss?w#o@rd@host -> scheme://<redacted>@host: a password may hold
# / ? # @ : unescaped. A URI ends at whitespace, a double quote or a backtick; not at
# "'", which RFC 3986 allows in userinfo (a sub-delim, like ! $ & ( ) * + , ; =):
# stopping there would show the rest of a password holding one.
_URI_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^\s\"`]*@")
# name=value pairs (URI query parameters, flags, free text) whose name is secret-looking:
# the value is masked up to whitespace, a double quote, a backtick or the next "&" (a
# "'" inside it is part of it).
_PAIR = re.compile(r"(?<![A-Za-z0-9_\-])([A-Za-z0-9_\-]+)=([^\s&\"'`][^\s&\"`]*)")
_SECRET_PARAM = re.compile(
    r"^-*(?:sig|signature|key|pwd|pass|code|sas|x-amz-credential|x-goog-credential)$"
    r"|signature|secret|passw|token(?!s|iz)|credential|api_?key|access_?key|auth(?!or(?!i))",
    re.IGNORECASE)
# Shorter environment values ("true", "1") would mask ordinary words; they are not secrets.
_MIN_ENV_SECRET_LEN = 6
# Secret strings `redact` has replaced, masked from then on in free text too: a config
# dumped into a text summary or a log line must not bring them back.
_SEEN_SECRETS: set[str] = set()
_SEEN_LOCK = threading.Lock()


# The environment's secret-looking values, with the raw environment they were read from:
# read again only when the environment changed (a config dump redacts hundreds of strings,
# and decoding and matching every variable for each cost ~1 ms).
_env_secrets_of: tuple[dict, frozenset[str]] = ({}, frozenset())


def _env_secrets() -> frozenset[str]:
    global _env_secrets_of
    raw = getattr(os.environ, "_data", None)  # the raw mapping os.environ keeps up to date
    current = dict(raw) if isinstance(raw, dict) else dict(os.environ)
    seen_env, values = _env_secrets_of
    if current != seen_env:
        values = frozenset(v for k, v in os.environ.items()
                           if _SECRET_ENV.search(k) and len(v) >= _MIN_ENV_SECRET_LEN)
        _env_secrets_of = (current, values)
    return values


def _known_secrets() -> list[str]:
    """Secret-looking environment values and secrets `redact` has seen, longest first."""
    values = set(_env_secrets())
    with _SEEN_LOCK:
        values |= _SEEN_SECRETS
    return sorted(values, key=len, reverse=True)


def redact_text(s: str) -> str:
    """Masks URI userinfo, secret-named parameters' values, secret environment values and
    secrets `redact` saw in `s`."""
    s = _URI_USERINFO.sub(rf"\1{REDACTED}@", str(s))
    s = _PAIR.sub(_mask_pair, s)
    for value in _known_secrets():
        s = s.replace(value, REDACTED)
    return s


def _mask_pair(m: re.Match) -> str:
    name = m.group(1)
    if _SECRET_PARAM.search(name) or _SECRET_KEY.search(name):
        return f"{name}={REDACTED}"
    return m.group(0)


def redact(tree):
    """A copy of `tree` (dicts, ConfigDicts, lists, tuples) with secrets replaced by "<redacted>".

    Values under a secret-looking key are replaced whole (bools and None are kept: they
    carry no secret) and, if strings, masked by `redact_text` from then on; every other
    string is passed through `redact_text`.
    """
    return _redact(tree, secret=False)


def _redact(node, secret: bool):
    if hasattr(node, "to_dict"):  # ml_collections ConfigDict / FrozenConfigDict
        node = node.to_dict()
    if isinstance(node, dict):
        return {k: _redact(v, secret or bool(_SECRET_KEY.search(str(k))))
                for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_redact(v, secret) for v in node]
        return items if isinstance(node, list) else tuple(items)
    if node is None or isinstance(node, bool):
        return node
    if secret:
        if isinstance(node, (str, bytes)) and len(node) >= _MIN_ENV_SECRET_LEN:
            with _SEEN_LOCK:
                _SEEN_SECRETS.add(node.decode("utf-8", "replace") if isinstance(node, bytes)
                                  else node)
        return REDACTED
    if isinstance(node, bytes):
        return redact_text(node.decode("utf-8", "replace"))
    if isinstance(node, str):
        return redact_text(node)
    return node
