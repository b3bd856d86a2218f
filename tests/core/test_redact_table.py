"""Masking that holds: a table of secret shapes (URI userinfo with / ? # @ : in the
password, tokens in the user slot, signed-URL and OAuth query parameters, flags), each
checked through redact_text, through redact (a config value under an ordinary key) and
through the files one real short run writes (config.json, run.json, the checkpoint's
control record, export.json, ...); and the stored config hash is that of the stored,
redacted config, so it cannot confirm a password guess."""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
import pytest
from flax import nnx

import jtrain
from jtrain import config as config_lib
from jtrain.checkpoint import export as export_lib
from jtrain.redact import REDACTED, redact, redact_text

# (text, the secrets in it)
SHAPES = [
    ("postgres://alice:Hx9wq2pz@db.example:5432/app", ["Hx9wq2pz"]),
    ("mysql://bob:Pw/sl4sh@db/x", ["Pw/sl4sh", "sl4sh"]),
    ("redis://:Qm?quest1on@cache:6379/0", ["Qm?quest1on", "quest1on"]),
    ("amqp://u:Hash#tag99@mq/vh", ["Hash#tag99", "tag99"]),
    ("mongodb://u:At@sign77@mongo/x", ["At@sign77", "sign77"]),
    ("https://u:Col:on:55@h.example/p", ["Col:on:55", "on:55"]),
    ("https://u:mix/?#@:Mx88@h.example/", ["Mx88"]),
    ("https://ghp_Tok3nTok3nTok3n@github.com/org/repo.git", ["ghp_Tok3nTok3nTok3n"]),
    ("https://ghp_UserSlotTok9:x-oauth-basic@github.com/o/r", ["ghp_UserSlotTok9"]),
    ("https://x-access-token:ghs_Acc3ssTok@github.com/o/r", ["ghs_Acc3ssTok"]),
    ("s3://AKIAEXAMPLEKEY1:wJalrXUtnFEMI9@bucket/key", ["wJalrXUtnFEMI9", "AKIAEXAMPLEKEY1"]),
    ("ftp://anon:Ftp$ecret1@files.example/pub", ["Ftp$ecret1", "ecret1"]),
    ("postgresql+psycopg2://svc:Pg%40enc0ded@db/x", ["Pg%40enc0ded", "enc0ded"]),
    ("wss://user:Ws5ecret!@stream.example/feed", ["Ws5ecret"]),
    ("jdbc:postgresql://u:JdbcPw12@h/db", ["JdbcPw12"]),
    ("https://acct.blob.core.windows.net/c/b?sv=2020&sig=AzSig%2Bval%3D&se=2030",
     ["AzSig%2Bval%3D", "AzSig"]),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIAQQQ%2F2024"
     "&X-Amz-Signature=abcdef0123456789", ["abcdef0123456789", "AKIAQQQ"]),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=9f8e7d6c5b4a", ["9f8e7d6c5b4a"]),
    ("https://api.example/v1?token=TkN0123abc&page=2", ["TkN0123abc"]),
    ("https://api.example/v1?access_token=AcT0kenzz", ["AcT0kenzz"]),
    ("https://api.example/v1?api_key=ApiK3yyy&q=x", ["ApiK3yyy"]),
    ("https://api.example/v1?key=Kk99plain", ["Kk99plain"]),
    ("https://h/p?password=Qpw0rd77#frag", ["Qpw0rd77"]),
    ("https://h/p?secret=Scr3tzz;x=1", ["Scr3tzz"]),
    ("https://h/p?signature=Sgn4ture00", ["Sgn4ture00"]),
    ("https://h/cb?code=OAuthC0de1&state=xyz", ["OAuthC0de1"]),
    ("https://h/p?client_secret=ClS3cret88", ["ClS3cret88"]),
    ("https://hooks.example/x?auth=AuthV4lue1", ["AuthV4lue1"]),
    ("https://u:Both1pw@h/p?token=Both2tok", ["Both1pw", "Both2tok"]),
    ("--config.data.kwargs.password=FlagPw123", ["FlagPw123"]),
    ("export HF_TOKEN=hf_EnvLik3Tok", ["hf_EnvLik3Tok"]),
    ("--db-password=Dash3dPw and more", ["Dash3dPw"]),
    ("Authorization=BearerT0k", ["BearerT0k"]),
    ("see postgres://u:Inl1nePw@h/x, then more text", ["Inl1nePw"]),
    ("postgresql://svc:Qu0te'Pw9x@db/app", ["Qu0te'Pw9x", "Pw9x"]),
    ("mysql://u:S!$&'()*+,;=ub9@db/x", ["S!$&'()*+,;=ub9", "()*+,;=ub9"]),
    ("--db-password=Fl4g'Quot3", ["Fl4g'Quot3", "Quot3"]),
]
# Ordinary text that stays as it is.
KEPT = ["max_tokens=512", "tokenizer=bpe", "s3://bucket/key", "https://h.example/p?page=2",
        "monkey=banana", "author=ada"]


@pytest.mark.parametrize("text, secrets", SHAPES, ids=[s[0][:40] for s in SHAPES])
def test_redact_text_and_redact_mask_the_shape(text, secrets):
    for out in (redact_text(text), redact({"data": {"note": text}})["data"]["note"],
                redact([text])[0], redact_text(redact_text(text))):
        assert REDACTED in out, out
        assert not [s for s in secrets if s in out], out
    assert len(SHAPES) >= 30


@pytest.mark.parametrize("text", KEPT)
def test_ordinary_text_is_kept(text):
    assert redact_text(text) == text


def test_environment_secrets_follow_the_environment(monkeypatch):
    """A secret-named variable set, changed or removed after text was redacted: the
    masking follows the environment as it is at each call."""
    monkeypatch.setenv("JT_TEST_TOKEN", "Env0ldT0ken")
    assert redact_text("x Env0ldT0ken y") == f"x {REDACTED} y"
    monkeypatch.setenv("JT_TEST_TOKEN", "EnvN3wT0ken")
    assert redact_text("Env0ldT0ken EnvN3wT0ken") == f"Env0ldT0ken {REDACTED}"
    monkeypatch.delenv("JT_TEST_TOKEN")
    assert redact_text("EnvN3wT0ken") == "EnvN3wT0ken"
    monkeypatch.setenv("JT_TEST_PASSWORD", "EnvN3wT0ken")  # another name, the same value
    assert redact_text("EnvN3wT0ken") == REDACTED


class Net(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def test_a_real_run_writes_no_secret_and_hashes_what_it_stores(tmp_path):
    """One short run with every shape in its config (data.kwargs, an ordinary key) and a
    secret under a secret key; then an export. No file of either holds a secret."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    kwargs = {f"s{i}": text for i, (text, _) in enumerate(SHAPES)}
    cfg = {"total_steps": 2, "data": {"batch_size": 8, "kwargs": {**kwargs,
                                                                  "password": "Pl41nPwd"}},
           "log": {"verbosity": 0, "writers": ["jsonl", "tensorboard"]}}
    run = tmp_path / "run"
    jtrain.train(cfg, str(run), model=Net(nnx.Rngs(0)),
                 train_data=(x, (x[:, 0] > 0).astype(np.int32)))
    export_lib.export(str(run), str(tmp_path / "exp"))
    secrets = ["Pl41nPwd"] + [s for _, ss in SHAPES for s in ss]
    files = {}
    for root, _, names in os.walk(tmp_path):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, tmp_path)] = open(path, "rb").read()
    written = [p for p in files if re.search(r"config\.json|run\.json|control/metadata|"
                                             r"export\.json", p)]
    assert {"run/config.json", "run/run.json", "exp/export.json"} <= set(written), written
    assert any("control/metadata" in p for p in written), sorted(files)
    events = [p for p in files if "tfevents" in p]
    assert events and any(b"<redacted>" in files[p] for p in events), sorted(files)
    leaks = [(p, s) for p, data in files.items() for s in secrets if s.encode() in data]
    assert not leaks, leaks
    stored = json.loads(files["run/config.json"])
    assert stored["data"]["kwargs"]["password"] == REDACTED
    assert stored["data"]["kwargs"]["s0"] == "postgres://<redacted>@db.example:5432/app"
    control = json.loads(next(files[p] for p in written if "control/metadata" in p))
    assert control["config_sha256"] == config_lib.config_hash(control["config"])
    guess = json.loads(json.dumps(control["config"]))
    guess["data"]["kwargs"] = {**kwargs, "password": "Pl41nPwd"}  # every guess right
    assert hashlib.sha256(json.dumps(guess, sort_keys=True, default=str).encode()
                          ).hexdigest() != control["config_sha256"]


# RFC 3986 userinfo: unreserved, sub-delims, ":" (the password's) and %-escapes
_UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
_SUB_DELIMS = "!$&'()*+,;="


def _userinfo(colon: bool):
    from hypothesis import strategies as st

    char = st.one_of(st.sampled_from(_UNRESERVED + _SUB_DELIMS + (":" if colon else "")),
                     st.integers(0, 255).map(lambda b: f"%{b:02X}"))
    return st.lists(char, min_size=1, max_size=24).map("".join)


def test_every_userinfo_character_is_masked():
    """Any user and password over the full userinfo alphabet: the URI comes out as
    scheme://<redacted>@host... exactly, alone, in a sentence, in a dict's repr, in JSON,
    in a config (redact) and in the "credentials in the URI are refused" line."""
    from hypothesis import given, settings, strategies as st

    from jtrain.checkpoint import store
    from jtrain.errors import WorkdirError, render

    @settings(deadline=None, derandomize=True, database=None, max_examples=300)
    @given(user=_userinfo(colon=False), password=_userinfo(colon=True),
           scheme=st.sampled_from(["postgresql", "mysql+pymysql", "s3", "redis"]))
    def check(user, password, scheme):
        uri = f"{scheme}://{user}:{password}@db.example:5432/app"
        masked = f"{scheme}://{REDACTED}@db.example:5432/app"
        assert redact_text(uri) == masked
        assert redact_text(f"storage {uri} refused") == f"storage {masked} refused"
        shown = str({"storage": uri})  # repr quotes it with " when it holds a '
        assert redact_text(shown) == shown.replace(uri, masked)
        assert redact_text(json.dumps({"storage": uri})) == json.dumps({"storage": masked})
        assert redact({"tune": {"storage": uri}}) == {"tune": {"storage": masked}}
        if scheme == "s3":
            try:
                store.split(uri)
            except WorkdirError as e:
                line = render(e)
            assert line.startswith(f"jtrain: workdir error: {masked}: credentials in the "
                                   "URI are refused: jtrain takes them from"), line

    check()
