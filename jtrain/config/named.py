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
