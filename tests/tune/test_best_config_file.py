"""best_config.py is fixed text plus data: strings from the study's database (params,
the trial's workdir) and from the config sit in data literals, never in the docstring or
in code, so none can run when the file is loaded; secrets are masked, one comment line
naming each masked key."""

from __future__ import annotations

import ast

from jtrain import config as config_lib
from jtrain.tune import results

ESCAPE = 'x"""\nimport builtins; builtins.PWNED = 1\n"""'


def _write(tmp_path, params, workdir, kwargs):
    base = config_lib.resolve({"model": {"name": "mlp"}, "data": {"kwargs": kwargs},
                               "tune": {"space": {"optim.lr": ("uniform", 0.1, 0.2)}}}
                              ).to_dict()
    rec = {"number": 3, "value": float("nan"), "params": params, "workdir": workdir}
    return results.write_best_config(str(tmp_path), base, rec, "eval/loss")


def test_database_strings_never_reach_code(tmp_path):
    path = _write(tmp_path, {"optim.lr": 0.125, "data.kwargs.note": ESCAPE},
                  f"trials/{ESCAPE}", {"note": "n", "k\nimport os": "v"})
    text = open(path).read()
    tree = ast.parse(text)
    docstring = ast.get_docstring(tree)
    assert "PWNED" not in docstring and "trials/" not in docstring
    # the module is: a docstring, two imports, the masked-key comments, two assignments
    # of literals and get_config; nothing else runs at import
    kinds = [type(node).__name__ for node in tree.body]
    assert kinds == ["Expr", "ImportFrom", "Import", "Assign", "Assign", "FunctionDef"], kinds
    for node in tree.body[3:5]:  # data only: literals, and the names nan and inf
        for sub in ast.walk(node.value):
            assert isinstance(sub, (ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Load,
                                    ast.UnaryOp, ast.USub)) or (
                isinstance(sub, ast.Name) and sub.id in ("nan", "inf")), ast.dump(sub)
    ns: dict = {}
    exec(compile(text, path, "exec"), ns)
    import builtins
    assert not hasattr(builtins, "PWNED")
    assert ns["TRIAL"]["workdir"] == f"trials/{ESCAPE}"
    cfg = ns["get_config"]()
    assert cfg.data.kwargs.note == ESCAPE and cfg.optim.lr == 0.125
    assert ns["TRIAL"]["value"] != ns["TRIAL"]["value"]  # nan, written and read back


def test_secrets_are_masked_with_one_comment_line_each(tmp_path):
    path = _write(tmp_path, {"optim.lr": 0.125}, "trials/3",
                  {"password": "Hunter2pw", "uri": "postgres://u:Pg5ecret@db/x", "n": 4})
    text = open(path).read()
    assert "Hunter2pw" not in text and "Pg5ecret" not in text
    comments = [line for line in text.splitlines() if line.startswith("# masked: ")]
    assert [c.split("'")[1] for c in comments] == ["data.kwargs.password", "data.kwargs.uri"]
    ns: dict = {}
    exec(text, ns)
    cfg = ns["get_config"]()
    assert cfg.data.kwargs.password == "<redacted>" and cfg.data.kwargs.n == 4
    assert cfg.data.kwargs.uri == "postgres://<redacted>@db/x"
