"""A run directory is data: its config.json names code (model.factory, data.source, ...)
that evaluate, replay and report import and call. A run trained here is signed with the
user's key and opens; the same run edited to name other code, or signed with another
user's key, is refused in one line before anything is imported, until `jtrain trust`;
the names on the short list trust.UNSIGNED need no signature (jtrain/observe/trust.py)."""

import json
import os
import stat

import pytest

import jtrain
from jtrain import cli, evaluate
from jtrain.engine import replay as replay_lib
from jtrain.errors import WorkdirError
from jtrain.observe import trust
from journey import copy_project

CFG = {"model": {"name": "user", "factory": "mymodels:make", "kwargs": {"hidden": 4}},
       "data": {"source": "mydata:make", "batch_size": 16}, "total_steps": 2,
       "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2},
       "log": {"verbosity": 0}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One small run trained in-process with the suite's key (tests/conftest.py)."""
    root = tmp_path_factory.mktemp("trust")
    copy_project(root, "mymodels", "mydata")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    mp.chdir(root)
    jtrain.train(CFG, "runs/a")
    mp.undo()
    return root


def _copy(trained, tmp_path, monkeypatch, name="runs/x"):
    import shutil

    shutil.copytree(trained / "runs/a", tmp_path / name)
    copy_project(tmp_path, "mymodels", "mydata")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return name


def _plant(run):
    """config.json edited (as anyone who can write the run could) to run a command."""
    path = os.path.join(run, "config.json")
    config = json.load(open(path))
    config["model"]["factory"] = "subprocess:getoutput"
    config["model"]["kwargs"] = {"cmd": "touch MARKER"}
    open(path, "w").write(json.dumps(config, indent=2, sort_keys=True))


def test_own_run_opens_an_edited_one_refuses_until_trusted(trained, tmp_path, monkeypatch,
                                                           capsys):
    run = _copy(trained, tmp_path, monkeypatch)
    assert os.path.isfile(os.path.join(run, trust.SIGNATURE_FILE))  # train signed it
    key = os.environ[trust.KEY_ENV]
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    report = evaluate.evaluate_checkpoint(run, plots=False)  # the user's own: no flag
    assert report["step"] == 2
    _plant(run)
    for open_run in (lambda: evaluate.evaluate_checkpoint(run, plots=False),
                     lambda: replay_lib.replay(run, 2)):
        with pytest.raises(WorkdirError) as e:
            open_run()
        assert str(e.value) == (
            "runs/x/config.json: names code that runs when it is opened: mydata:make "
            "(data.source), subprocess:getoutput (model.factory); if you trust it: "
            "jtrain trust runs/x")
        assert e.value.exit_code == 2
    # the recipes' report command: the same line, exit 2, nothing imported
    from jtrain.recipes import report as report_cmd

    json.dump({"step": 2}, open(os.path.join(run, "summary.json"), "w"))
    assert report_cmd.main([run]) == 2
    assert "jtrain: workdir error: runs/x/config.json: names code" in capsys.readouterr().err
    assert not os.path.exists("MARKER")
    # the command line: one line, exit 2; then `jtrain trust` shows and signs it
    assert cli.main(["evaluate", f"--workdir={run}", "--no_plots"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "jtrain: workdir error: runs/x/config.json: names code that runs")
    # no terminal and no --yes: refused in one line, nothing signed
    sig = open(os.path.join(run, trust.SIGNATURE_FILE)).read()
    assert cli.main(["trust", run]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "jtrain: usage error: --yes: no terminal to confirm on; read what "
        "runs/x/config.json names, then: jtrain trust --yes runs/x")
    # on a terminal it shows each name with its key and asks; "n" signs nothing
    answers = []
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: answers.pop(0))
    answers.append("n")
    assert cli.main(["trust", run]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[1:] == ["  data.source = mydata:make",
                                    "  model.factory = subprocess:getoutput"]
    assert err.strip().splitlines()[-1] == (
        "jtrain: usage error: RUN: not confirmed; runs/x/config.json is not signed")
    assert open(os.path.join(run, trust.SIGNATURE_FILE)).read() == sig
    answers.append("y")
    assert cli.main(["trust", run]) == 0
    assert "jtrain: trusted runs/x/config.json" in capsys.readouterr().out
    trust.check(run, json.load(open(os.path.join(run, "config.json"))))  # now it opens
    assert not os.path.exists("MARKER")


def test_a_run_signed_with_another_users_key_refuses(trained, tmp_path, monkeypatch):
    run = _copy(trained, tmp_path, monkeypatch)
    mine = os.environ[trust.KEY_ENV]
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "theirs.key"))
    trust.sign(run)  # their jtrain signed it with their key
    assert trust.verify(run)
    monkeypatch.setenv(trust.KEY_ENV, mine)
    assert not trust.verify(run)
    with pytest.raises(WorkdirError, match=r"mydata:make \(data.source\), mymodels:make "
                                           r"\(model.factory\); if you trust it"):
        evaluate.evaluate_checkpoint(run, plots=False)
    # a model passed from Python is not imported: only the data source needs trust
    import mymodels

    with pytest.raises(WorkdirError, match=r"names code that runs when it is opened: "
                                           r"mydata:make \(data.source\); if"):
        evaluate.evaluate_checkpoint(run, plots=False, model=mymodels.make(hidden=4))


def test_jtrain_paths_need_no_signature(tmp_path):
    config = {"data": {"source": "jtrain.recipes.classify:make_data"},
              "step": {"factory": "jtrain.recipes.byol:make"}, "seed": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    trust.check(str(tmp_path), config)  # no config.json.sig, opens
    # a name jtrain merely imported, or a path into it, is not jtrain's own code
    for path in ("jtrain.observe.trust:os.system", "jtrain.observe.trust:secrets",
                 "jtraining:make", "jtrain:train"):
        assert trust.untrusted({"loss": {"fn": path}}) == [(path, "loss.fn")], path
    assert trust.import_paths({"data": {"mixture": {"a": {"source": "pkg.m:f"},
                                                     "b": {"source": "pystdlib"}}}}) == [
        ("pkg.m:f", "data.mixture.a.source")]
    # at a key that only names code every string is a name, ":" or not
    assert trust.import_paths({"model": {"factory": "runs.evil"}, "loss": {"fn": "x"},
                               "optim": {"name": "adamw"}}) == [
        ("runs.evil", "model.factory"), ("x", "loss.fn")]


def _defined_in_jtrain() -> set[str]:
    """Every "module:name" and "module" jtrain's source defines or binds at top level
    (functions, classes and their methods, assignments, imports), read with ast: nothing
    imported."""
    import ast

    root = os.path.dirname(jtrain.__file__)
    names = set()
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3]
            module = rel.replace(os.sep, ".").removesuffix(".__init__")
            names.add(module)
            tree = ast.parse(open(os.path.join(d, f)).read())
            for node in tree.body:
                bound = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                          ast.AsyncFunctionDef))
                         else [t.id for t in getattr(node, "targets", [])
                               if isinstance(t, ast.Name)]
                         + [(a.asname or a.name).split(".")[0]
                            for a in getattr(node, "names", []) if not isinstance(a, str)])
                names.update(f"{module}:{b}" for b in bound)
                if isinstance(node, ast.ClassDef):
                    names.update(f"{module}:{node.name}.{m.name}" for m in node.body
                                 if isinstance(m, ast.FunctionDef))
    return names


def test_what_a_config_may_name_unsigned_is_exactly_the_documented_list():
    import glob
    import re

    defined = _defined_in_jtrain()
    assert {"jtrain.bench.scaling:_spawn", "jtrain.verify.resume:_run",
            "jtrain.checkpoint.integrity:quarantine", "jtrain.recipes.byol"} <= defined
    opens_unsigned = {p for p in defined for key in trust.CODE_KEYS
                      if not trust.untrusted(_at(key, p))}
    assert opens_unsigned == set(trust.UNSIGNED)
    # each is a public function its module defines ...
    assert all(p in defined and not p.split(":")[1].startswith("_") for p in trust.UNSIGNED)
    # ... that a config jtrain ships names; and every jtrain name those configs use is on it
    repo = os.path.dirname(os.path.dirname(jtrain.__file__))
    shipped = set()
    for path in glob.glob(os.path.join(repo, "configs", "recipes", "*.py")) + [
            os.path.join(repo, "jtrain", "bench", "peers.py")]:
        shipped |= set(re.findall(r"[\"'](jtrain\.[\w.]+:\w+)[\"']", open(path).read()))
    assert shipped == set(trust.UNSIGNED)
    # the trust page's table is the list, with the same words
    page = open(os.path.join(repo, "docs", "guide", "forensics.md")).read()
    table = dict(re.findall(r"^\| `(jtrain\.[\w.]+:\w+)` \| (.+) \|$", page, re.M))
    assert table == trust.UNSIGNED


def _at(key: str, value: str) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


def test_the_signature_covers_the_whole_config(tmp_path):
    """A name past the first 4 KiB of config.json, edited in place after signing, is
    refused: the HMAC is of every byte (compared with hashlib's HMAC of the file)."""
    import hashlib
    import hmac

    config = {"data": {"kwargs": {"notes": "x" * 4200}, "source": "jtrain.recipes."
                       "classify:make_data"}, "step": {"factory": "mystep:make"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config, sort_keys=True))
    trust.sign(str(tmp_path))
    content = path.read_bytes()
    assert content.index(b"mystep:make") > 4096
    key = open(os.environ[trust.KEY_ENV], "rb").read().strip()
    assert (tmp_path / trust.SIGNATURE_FILE).read_text().strip() == hmac.new(
        key, content, hashlib.sha256).hexdigest()
    trust.check(str(tmp_path), config)  # signed: opens
    path.write_bytes(content.replace(b"mystep:make", b"mystep:evil"))  # same length
    with pytest.raises(WorkdirError, match=r"names code that runs when it is opened: "
                                           r"mystep:evil \(step.factory\); if you trust"):
        trust.check(str(tmp_path), json.loads(path.read_text()))


def _key_cases(tmp_path):
    """(key file, the line's why): keys others could read, replace or guess."""
    good = tmp_path / "good.key"
    good.write_text("ab" * 32 + "\n")
    good.chmod(0o600)
    cases = []
    for name, content, mode in (("empty", "", 0o600), ("short", "0123456789abcdef\n", 0o600),
                                ("shared", "ab" * 32, 0o640), ("open", "ab" * 32, 0o606)):
        path = tmp_path / f"{name}.key"
        path.write_text(content)
        path.chmod(mode)
        cases.append((path, {
            "empty": "the trust key is 0 bytes, under 32; remove it and a new one is made",
            "short": "the trust key is 16 bytes, under 32; remove it and a new one is made",
            "shared": f"the trust key is open to others (mode 0640); chmod 600 {path}",
            "open": f"the trust key is open to others (mode 0606); chmod 600 {path}"}[name]))
    link = tmp_path / "link.key"
    link.symlink_to(good)
    cases.append((link, "the trust key is a symbolic link; put the key file itself there "
                        "(or set JTRAIN_TRUST_KEY_FILE=FILE)"))
    if os.getuid() == 0:  # root can hand a file to another user
        theirs = tmp_path / "theirs.key"
        theirs.write_text("ab" * 32)
        theirs.chmod(0o600)
        os.chown(theirs, 65534, 65534)
        uid = 65534
    else:
        theirs, uid = "/etc/passwd", os.stat("/etc/passwd").st_uid
    cases.append((theirs, f"the trust key belongs to uid {uid}, not to you (uid "
                          f"{os.getuid()}); remove it and a new one is made"))
    return good, cases


def test_a_key_others_could_read_replace_or_guess_signs_nothing(tmp_path, monkeypatch,
                                                               capsys):
    run = tmp_path / "run"
    run.mkdir()
    config = {"model": {"factory": "mymodels:make"}}
    (run / "config.json").write_text(json.dumps(config))
    good, cases = _key_cases(tmp_path)
    monkeypatch.setenv(trust.KEY_ENV, str(good))
    trust.sign(str(run))  # signed with the good key; each bad one below refuses to verify
    signed = (run / trust.SIGNATURE_FILE).read_text()
    for path, why in cases:
        monkeypatch.setenv(trust.KEY_ENV, str(path))
        with pytest.raises(WorkdirError) as e:
            trust.check(str(run), config)
        assert str(e.value) == f"{path}: {why}"
        assert cli.main(["trust", "--yes", str(run)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"jtrain: workdir error: {path}: {why}")
        assert (run / trust.SIGNATURE_FILE).read_text() == signed
    # the user's own private key of 64 hex digits signs; --yes asks nothing
    os.remove(run / trust.SIGNATURE_FILE)
    monkeypatch.setenv(trust.KEY_ENV, str(good))
    assert cli.main(["trust", "--yes", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "  model.factory = mymodels:make"
    trust.check(str(run), config)
    # a key jtrain makes is private: 0600, the user's, 64 hex digits
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "new" / "trust.key"))
    key = trust.user_key()
    st = os.stat(tmp_path / "new" / "trust.key")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, len(key)) == (0o600, os.getuid(), 64)
    assert int(key, 16) >= 0 and os.listdir(tmp_path / "new") == ["trust.key"]
