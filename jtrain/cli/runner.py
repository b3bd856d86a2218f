"""The one command-line framework of jtrain's entry points (`jtrain.main`, `jtrain.evaluate`,
`jtrain.export`, `jtrain.tune`, `jtrain.bench`): absl flags, so `--flag=value`,
`--flag value`, `--flag/--noflag` and positional arguments between flags behave the same
everywhere, and ONE error and exit path for every command.

    run(prog, define_flags, main, argv, run_log=None) -> exit code

parses `argv` on a fresh `flags.FlagValues` (in-process calls never collide), answers
`--help`, and calls `main(flag_values, positional_args)`. A command with a config file
flag (`--config=FILE[:variant]`, ml_collections' config_flags; or `--config=NAME[:variant]`,
a config shipped in jtrain/configs/ named by its path there without `.py`: `base:debug`,
`recipes/classify`) gets `--config.a.b=value`
overrides, free-form `data.kwargs` / `model.kwargs` keys, and its loading errors as one
`config error` line. Every jtrain error (`jtrain.errors.JtrainError`), every OSError
`errors.classify` names (a full disk, a read-only or unwritable directory) and, in a
multi-process run, a failed collective (a peer error) becomes its one line on stderr and
its exit code; a bad flag is a `UsageError` (exit 2). Anything else is a bug: its
traceback, then `jtrain: internal error: ...`, exit 1. `run_log(fv) -> (workdir,
verbosity) | None` (the train command): library logs go to WORKDIR/train.log (below
verbosity 2), and so does the traceback behind an error line. How a command ends (its
peers told, a multi-process run leaving at once) is jtrain.cli.exits.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import sys
from collections.abc import Callable

from absl import flags

from jtrain import errors
from jtrain import boot
from jtrain.cli import exits


def wants_help(argv) -> bool:
    return any(a in HELP_FLAGS for a in argv)


HELP_FLAGS = ("--help", "-h", "--helpfull", "--helpshort", "-?")


def print_help(prog: str, fv: flags.FlagValues, description: str = ""):
    """The flags of `fv` on stdout, then exit 0 (absl's own --help exits 1)."""
    sys.stdout.write(f"usage: {prog} [flags]\n\n{description.strip()}\n\nflags:\n"
                     f"{fv.get_help(include_special_flags=False)}\n")
    sys.stdout.flush()
    raise SystemExit(0)


def parse(prog: str, define_flags: Callable, argv, description: str = ""
          ) -> tuple[flags.FlagValues, list[str]]:
    """(flag values, positional args); `--help` prints the flags and exits 0; a bad
    flag raises UsageError, a bad config file or override ConfigError."""
    fv = flags.FlagValues()
    define_flags(fv)
    return fv, parse_into(fv, prog, argv, description)


def parse_into(fv: flags.FlagValues, prog: str, argv, description: str = "") -> list[str]:
    """`parse` on flags already defined in `fv`; returns the positional args. With a
    `--config` file flag, define it with `sys_argv=[prog, *split_free_form(argv)[0]]`:
    config_flags reads the overrides from there."""
    from absl import logging as absl_logging

    argv = list(argv)
    if wants_help(argv):
        print_help(prog, fv, description)
    given = argv  # errors name the config as typed (`base`), not its packaged path
    if "config" in fv:
        argv = with_packaged_config(argv)
    if "config" not in fv:  # no config file: absl's errors are the only ones
        try:
            return fv([prog, *argv])[1:]
        except flags.Error as e:
            key, why = describe_flag_error(e, argv)
            raise errors.UsageError(key, why) from None
    # config_flags loads every file as module "config_config" and reuses a loaded one:
    # a file without get_config() would borrow the previous file's (in-process runs)...
    sys.modules.pop("config_config", None)

    def quiet(record):  # ...and logs a warning for get_config() -> None (our one line)
        return "get_config() returned None" not in record.getMessage()

    absl_logging.get_absl_logger().addFilter(quiet)
    argv, free_form = split_free_form(argv)
    try:
        rest = fv([prog, *argv])[1:]
        if fv["config"].present:
            config = fv.config
            # config_flags defers a missing or unreadable file until the config is touched.
            getattr(config, "lock", None)
            if not isinstance(config, dict) and not hasattr(config, "to_dict"):
                raise TypeError(f"get_config() returned {type(config).__name__}, "
                                "expected a ConfigDict")
            apply_free_form(config, free_form)
        elif free_form:
            raise errors.ConfigError(free_form[0][0], "override given without --config")
        return rest
    except errors.JtrainError:
        raise
    except SystemExit as e:  # get_config() called sys.exit: it is the file's error
        raise errors.ConfigError(config_file(given), "get_config() called sys.exit("
                                 f"{e.code!r}) while the config was loading") from None
    except Exception as e:  # noqa: BLE001 - flags.Error, and what config_flags raises loading
        key, why = describe_flag_error(e, argv)
        key = config_file(given) if key == config_file(argv) else key
        if key.startswith("--") and not key.startswith("--config"):  # not a config key
            raise errors.UsageError(key, why) from None
        raise errors.ConfigError(key, why) from None
    finally:
        absl_logging.get_absl_logger().removeFilter(quiet)


def run(prog: str, define_flags: Callable, main: Callable, argv=None,
        description: str = "", run_log: Callable | None = None) -> int:
    """Parse, run `main(fv, args)`; every failure is one line and an exit code."""
    argv = sys.argv[1:] if argv is None else argv
    workdir, undo = "", None
    try:
        fv, args = parse(prog, define_flags, argv, description)
        boot.mark_absl_parsed()
        target = run_log(fv) if run_log is not None else None
        if target is not None:
            from jtrain.observe import liblogs

            workdir, undo = target[0], liblogs.to_train_log(*target)
        code = int(main(fv, args) or 0)
    except Exception as e:  # noqa: BLE001 - every failure is one line (jtrain.errors)
        return exits.fail(e, workdir)
    finally:
        if undo is not None:
            undo()
    return exits.done(code)


# -- config-file flags -----------------------------------------------------------------
# `--config=FILE[:variant]` and `--config.a.b=value` are ml_collections' config_flags; what
# they raise is rewritten here as `<dotted.key or file>: <why>`. An unknown override key is
# found by walking argv's overrides against jtrain's schema; the rest (config_flags gives
# no structured error for them) match its messages. tests/bad_input/test_config_errors.py
# holds every case.


def describe_flag_error(error: Exception, argv) -> tuple[str, str]:
    """`(dotted.key or --flag or file, why)` for what absl / config_flags raised."""
    if isinstance(error, AttributeError) and error.args and isinstance(error.args[0], KeyError):
        error = error.args[0]  # config_flags wraps a typo below the top level: optim.lrr
    if _raised_in_file(error, config_file(argv)):  # get_config() itself raised
        return _describe_file_error(error, config_file(argv))
    if isinstance(error, KeyError):  # an override names a key the config does not have
        return _describe_unknown_key(error, argv)
    text = str(error)
    if not isinstance(error, flags.Error):  # raised while loading the config file
        return _describe_file_error(error, config_file(argv))
    # absl's flag errors are text only: their parts are matched here, once.
    m = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text, re.DOTALL)
    if m:
        return m.group(1), _plain_why(m.group(3).strip().splitlines()[-1])
    m = re.match(r"flag --(\w+)=(.*?): (.*)", text, re.DOTALL)  # a plain flag's bad value
    if m and m.group(1) != "config":
        return f"--{m.group(1)}", _plain_why(m.group(3).strip().splitlines()[-1])
    m = re.match(r"Missing value for flag --config\.([\w.]+)", text)
    if m:
        return m.group(1), "missing value"
    m = re.match(r"Found --?config\.([\w.]+)\S* in argv before a value for --config", text)
    if m:
        return m.group(1), "override given before --config=...; put --config first"
    m = re.match(r"Flag --config\.([\w.]+) is provided after --config\.([\w.]+)", text)
    if m:
        return m.group(1), f"given after --config.{m.group(2)}, and would overwrite it"
    m = re.match(r"flag --config=([^:]*)(:\S*)?: Error whilst parsing config file", text)
    if m:  # get_config raised: config_flags kept only its traceback's text
        return _get_config_error(error, m.group(1), text)
    if isinstance(error, flags.UnrecognizedFlagError):
        return f"--{error.flagname}", "unknown flag"
    return errors.first_line(error), ""  # nothing matched: the line as it is


def _get_config_error(error: Exception, path: str, text: str) -> tuple[str, str]:
    """(path, why) for an exception get_config() raised, which config_flags re-raised as
    the text of its traceback: a jtrain error's fields when it is still in the chain,
    else the traceback's last line less the exception's type name."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, errors.JtrainError) and error.key is not None:
            return (path, error.why) if error.key == path else (path, errors.message(
                error.key, error.why))
        error = error.__cause__ or error.__context__
    last = [ln for ln in text.strip().splitlines() if ln.strip()][-1]
    m = re.match(r"(?:[\w.]+: )?(.*)", last)  # `ValueError: why` -> why
    why = m.group(1)
    prefix = f"{path}: "
    return (path, why[len(prefix):]) if why.startswith(prefix) else (path, why)


def _describe_unknown_key(error: KeyError, argv) -> tuple[str, str]:
    """(override key, `unknown key[; did you mean "x"?]`), from the overrides in argv
    walked against jtrain's schema (every model family's keys allowed)."""
    from jtrain.config.schema import MODEL_FAMILIES, SCHEMA, Field

    model = dict(SCHEMA["model"])
    for family in MODEL_FAMILIES.values():
        model.update(family)
    schema = {**SCHEMA, "model": model}
    keys = [a.lstrip("-")[len("config."):].split("=", 1)[0] for a in argv
            if a.startswith(("--config.", "-config."))]
    from jtrain.config import renamed

    for key in keys:
        why = renamed.new_name(key)
        if why:  # an old name: the new one, in one line
            return key, why
        node, parts = schema, key.split(".")
        for i, part in enumerate(parts):
            if isinstance(node, Field):  # --config.optim.lr.x=1: below a plain value
                return key, f"unknown key; {'.'.join(parts[:i])} is a value, not a section"
            if part not in node:
                close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6)
                return key, "unknown key" + (f'; did you mean "{close[0]}"?' if close else "")
            node = node[part]
    # Every override is a schema key: one the config file leaves out (its KeyError's
    # argument is the missing name).
    bad = errors.first_line(error).strip("'\"")
    key = next((k for k in keys if bad in k.split(".")), bad)
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == "model" and parts[1] not in SCHEMA["model"]:
        families = [n for n, fields in MODEL_FAMILIES.items() if parts[1] in fields]
        if families:  # a key of another model family than the config file's
            return key, (f"a key of model.name={' or '.join(map(repr, families))} only, not "
                         "of this config's model; set model.name in the config file (e.g. "
                         f"defaults(model={families[0]!r})) to get its keys")
    return key, "unknown key"


def _raised_in_file(error: BaseException, path: str) -> bool:
    """Did `error` (or what it wraps) come out of code in the config file `path`?"""
    target = os.path.abspath(path)
    for e in (error, error.__cause__, error.__context__):
        tb = getattr(e, "__traceback__", None)
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == target:
                return True
            tb = tb.tb_next
    return False


def config_file(argv) -> str:
    """The path part of `--config=PATH[:variant]` (or `--config PATH`) in argv."""
    for i, a in enumerate(argv):
        m = re.match(r"--?config(=|$)(.*)", a)
        if m:
            value = m.group(2) if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else "")
            return value.split(":", 1)[0] or "--config"
    return "--config"


# -- packaged configs -------------------------------------------------------------------
# The reference and recipe configs ship inside the package, in jtrain/configs/ (the
# checkout's configs/ is the same folder). `--config=NAME[:variant]`, NAME a path below that
# folder without `.py` (`base`, `recipes/classify`), names one, so an installed wheel runs
# them from any directory. A file that exists at the given path is that file, as before.

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
_CONFIG_NAME = re.compile(r"\w+(/\w+)*")


def packaged_configs() -> list[str]:
    """The names `--config=NAME` accepts: base, gpt2_small, recipes/classify, ..."""
    return sorted(os.path.relpath(os.path.join(d, f), CONFIGS)[:-3].replace(os.sep, "/")
                  for d, _, files in os.walk(CONFIGS) for f in files if f.endswith(".py"))


def packaged_config(value: str) -> str:
    """`NAME[:variant]` -> `/path/of/jtrain/configs/NAME.py[:variant]` when NAME is a
    packaged config and no file NAME exists; anything else unchanged."""
    path, sep, variant = value.partition(":")
    if not _CONFIG_NAME.fullmatch(path) or os.path.exists(path):
        return value
    packaged = os.path.join(CONFIGS, *path.split("/")) + ".py"
    return packaged + sep + variant if os.path.isfile(packaged) else value


def with_packaged_config(argv: list[str]) -> list[str]:
    """argv with the value of `--config=VALUE` (or `--config VALUE`) through packaged_config."""
    out = list(argv)
    for i, a in enumerate(out):
        m = re.match(r"(--?config=)(.*)", a, re.DOTALL)
        if m:
            out[i] = m.group(1) + packaged_config(m.group(2))
        elif re.fullmatch(r"--?config", a) and i + 1 < len(out):
            out[i + 1] = packaged_config(out[i + 1])
    return out


def _describe_file_error(error: Exception, path: str) -> tuple[str, str]:
    inner = error.__cause__ or error  # a deferred load error is re-raised as its cause
    if isinstance(inner, SyntaxError):
        return path, f"syntax error at line {inner.lineno}: {inner.msg}"
    if isinstance(inner, OSError):
        if inner.strerror:  # permission denied, is a directory, ...
            return path, f"cannot read: {inner.strerror.lower()}"
        if "Attempted" in str(inner):  # config_flags' file-not-found report
            if _CONFIG_NAME.fullmatch(path):  # meant as a packaged config's name?
                return path, ("no such file, nor a packaged config (one of: "
                              f"{', '.join(packaged_configs())})")
            return path, "no such file"
        return path, f"cannot read: {errors.first_line(inner)}"
    if isinstance(inner, AttributeError) and "get_config" in str(inner):
        return path, "has no get_config() function"
    if isinstance(inner, TypeError) and str(inner).startswith("get_config() returned"):
        return path, str(inner)
    first = errors.first_line(inner) if str(inner).strip() else ""
    return path, type(inner).__name__ + (f": {first}" if first else "")


def _plain_why(why: str) -> str:
    """Python's parse errors in the words jtrain.config uses."""
    m = re.match(r"invalid literal for int\(\) with base 10: (.*)", why)
    if m:
        return f"must be an integer, got {m.group(1)}"
    m = re.match(r"could not convert string to float: (.*)", why)
    if m:
        return f"must be a number, got {m.group(1)}"
    m = re.match(r"\('Non-boolean argument to boolean flag', (.*)\)$", why)
    if m:
        return f"must be true or false, got {m.group(1)}"
    return why


# -- free-form dicts on the command line -----------------------------------------------
# data/model/step/optim.kwargs are free-form: `--config.data.kwargs.NAME=value` may name a
# key the config file does not have. config_flags only overrides existing keys, so these
# are taken out of argv before it parses and set on the loaded config after.


def split_free_form(argv) -> tuple[list[str], list[tuple[str, str]]]:
    """(argv without the free-form overrides, [(dotted key, raw value), ...])."""
    kept, free = [], []
    for a in argv:
        m = re.match(r"--?config\.((?:data|model|step|optim)\.kwargs\.[\w.]+)=(.*)", a,
                     re.DOTALL)
        if m:
            free.append((m.group(1), m.group(2)))
        else:
            kept.append(a)
    return kept, free


def parse_value(raw: str):
    """A command-line value: a Python literal (1, 0.5, 'a', [1, 2], None), true / false,
    or else the text itself."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def apply_free_form(config, overrides) -> None:
    """Sets each (dotted key, raw value) on the loaded `config` (a locked ConfigDict or a
    dict), creating names below data/model/step/optim.kwargs as needed."""
    for key, raw in overrides:
        parts = key.split(".")
        node = config
        for i, part in enumerate(parts[:-1]):
            child = node.get(part) if hasattr(node, "get") else None
            if child is None:  # validation reports a kwargs the model family lacks
                _set(node, part, {})
                child = node[part]
            elif not hasattr(child, "get"):
                raise errors.ConfigError(key, f"{'.'.join(parts[:i + 1])} is a value, "
                                              "not a section")
            node = child
        _set(node, parts[-1], parse_value(raw))


def _set(node, name, value) -> None:
    if hasattr(node, "unlocked"):  # a locked ConfigDict: new names need unlocking
        with node.unlocked():
            node[name] = value
    else:
        node[name] = value
