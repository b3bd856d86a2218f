"""The config reference, written from the schema (the one place descriptions live):

    resolved_text(config)   `python -m jtrain.main --config=... --print_config`: every key
                            of the resolved config with its value, type, default, range or
                            choices and description; `*` marks a value that is not the
                            default
    markdown()              docs/reference/config.md: every key of every section and model family
                            (`python -m jtrain.config --markdown > docs/reference/config.md`;
                            tests/config/test_config_reference.py fails when the file drifts)
"""

from __future__ import annotations

from jtrain.config.fields import OpenChoices
from jtrain.config.schema import INT_MAX, MODEL_FAMILIES, SCHEMA, Field, fields, schema_for

_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", "strs": "list[str]",
               "ints": "list[int]", "dict": "dict",
               "pairs": "list[(str, str)]", "optfloat": "float or None"}


def type_name(field: Field) -> str:
    return _TYPE_NAMES.get(field.type, str(field.type))


def allowed(field: Field) -> str:
    """`[lo, hi]`, `>= lo`, `one of a, b` or '' for a field's check."""
    check = field.check
    if not check:
        return ""
    if isinstance(check, tuple) and len(check) == 2 and not isinstance(check[0], str):
        lo, hi = check
        if hi is None or hi == INT_MAX and field.type is int:
            return f">= {lo:g}" if lo is not None else ""
        return f"[{lo:g}, {hi:g}]"
    word = "items from" if field.type in ("strs", "ints") else "one of"
    more = f", or {check.prefix}NAME" if isinstance(check, OpenChoices) else ""
    return f"{word} {', '.join(map(str, check))}{more}"


def show(value) -> str:
    """A value as a person types it on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if value is None:
        return "None"
    return repr(value)


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def resolved_text(config) -> str:
    """The resolved config, one key a line: `key = value  (type; default; range) doc`."""
    from jtrain.config import resolve  # the package imports this module: resolve lazily
    from jtrain.redact import redact  # imports nothing of jtrain

    cfg = redact(resolve(config).to_dict())  # values under secret keys masked
    family = cfg["model"]["name"]
    rows = []
    for key, field in fields(schema_for(family)):
        value = _get(cfg, key)
        default = field.default
        same = (tuple(value) == tuple(default) if isinstance(value, (list, tuple))
                and isinstance(default, (list, tuple)) else value == default)
        facts = [type_name(field), f"default {show(default)}"]
        if allowed(field):
            facts.append(allowed(field))
        rows.append((("  " if same else "* ") + f"{key} = {show(value)}",
                     f"({'; '.join(facts)}) {field.doc}"))
    width = min(max(len(r[0]) for r in rows), 56)
    head = (f"# jtrain config, resolved (model family {family!r}); * = not the default.\n"
            "# Set any key with --config.KEY=VALUE; every key: docs/reference/config.md\n")
    return head + "".join(f"{a:<{width}}  {b}\n" for a, b in rows)


def _table(rows) -> str:
    out = ["| key | type | default | allowed | resume | description |",
           "|---|---|---|---|---|---|"]
    for key, field in rows:
        resume = "yes" if field.resume else ""
        cells = [f"`{key}`", type_name(field), f"`{show(field.default)}`", allowed(field),
                 resume, field.doc]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def markdown() -> str:
    """docs/reference/config.md: every key, section by section, then each model family's keys."""
    parts = ["# Config reference\n",
             "Generated from `jtrain/config/schema.py` by "
             "`python -m jtrain.config --markdown > docs/reference/config.md` (a test fails "
             "when this file differs from the schema). Set a key with `--config.KEY=VALUE`; "
             "`python -m jtrain.main --config=FILE --print_config` prints a config's "
             "resolved values. *resume*: may differ when a run resumes without "
             "`checkpoint.allow_changes`. New names below the free-form dicts "
             "`data.kwargs` and `model.kwargs` are accepted from the command line "
             "(`--config.data.kwargs.log_dir=logs`).\n"]
    top = [(k, f) for k, f in SCHEMA.items() if isinstance(f, Field)]
    parts += ["## Top level\n", _table(top)]
    for section, spec in SCHEMA.items():
        if isinstance(spec, dict):
            parts += [f"## {section}\n", _table(list(fields(spec, f"{section}.")))]
    for family, spec in MODEL_FAMILIES.items():
        parts += [f"## model.* of the `{family}` family (model.name={family!r})\n",
                  _table(list(fields(spec, "model.")))]
    return "\n".join(parts)
