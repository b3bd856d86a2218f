"""The object a config key names as "package.module:attribute" (data.source,
data.transform, data.valid_fn, loss.fn, loss.terms.*.fn, model.factory,
eval.predict_fn), or that key's own error saying why not."""

from __future__ import annotations

import importlib

from jtrain.errors import DataError, first_line


def load_named(path: str, key: str, error: type = DataError):
    """The object at "package.module:attribute"; otherwise `error(key, why)`: a DataError
    for data.* keys, ConfigError for the others (loss.fn, model.factory)."""
    if not isinstance(path, str) or ":" not in path or path.startswith(":"):
        raise error(key, f"expected 'package.module:function', got {path!r}")
    module_name, attr = path.split(":", 1)
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise error(key, f"cannot import {module_name!r} ({e}); is it on PYTHONPATH?") \
            from None
    except Exception as e:
        raise error(key, f"importing {module_name!r} raised {type(e).__name__}: "
                         f"{first_line(e)}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(key, f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def call_factory(section: str, factory, path: str, kwargs: dict, shown: dict):
    """`factory(**kwargs)` named by `<section>.factory` = `path`: what it raises as the
    config's error, one line (a TypeError: `<section>.kwargs`; anything else:
    `<section>.factory`); `shown`: the kwargs as the config gave them (the line's)."""
    from jtrain.errors import ConfigError

    try:
        return factory(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # wrong keyword arguments: the config's fault
        raise ConfigError(f"{section}.kwargs", f"{path}(**{shown}) raised TypeError: {e}"
                          ) from None
    except Exception as e:  # noqa: BLE001 - the user's factory: its first line
        raise ConfigError(f"{section}.factory", f"{path}(**{shown}) raised "
                                                f"{type(e).__name__}: {first_line(e)}") from None
