"""The metric writers checked at start-up, before data, build or any step: each failure
one line (`ConfigError` naming the `log.*` key) with the fix; nothing is created (a
folder is probed with a temporary file). `MetricWriter` turns what still fails when a writer opens
into the same kind of line (`setup_error`).
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse

from jtrain.errors import ConfigError, first_line

_FILE_STORE_FIX = ("MLflow refuses a file: store unless MLFLOW_ALLOW_FILE_STORE=true is "
                   "set; use sqlite:///PATH/mlflow.db (or '' for WORKDIR/mlflow.db), or "
                   "set MLFLOW_ALLOW_FILE_STORE=true")


def check(workdir: str, log_cfg, names: tuple[str, ...]) -> None:
    """ConfigError for a writer in `names` (log.writers) that cannot start."""
    if "tensorboard" in names:
        _writable_dir(os.path.join(workdir, "tb"), "log.writers",
                      "tensorboard cannot write its event files to")
    if "wandb" in names:
        _writable_dir(os.path.join(workdir, "wandb"), "log.writers",
                      "wandb cannot write its offline run to")
    if "mlflow" in names:
        check_mlflow_uri(log_cfg.get("mlflow_tracking_uri", "") or "")


def check_mlflow_uri(uri: str) -> None:
    """A file store (`file:...` or a plain path) that this MLflow refuses; the folder of
    a `sqlite:///` database that cannot be written."""
    if not uri:
        return
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("", "file") or (len(scheme) == 1 and uri[1:2] == ":"):  # C:\...
        if _mlflow_refuses_file_store():
            raise ConfigError("log.mlflow_tracking_uri", _FILE_STORE_FIX)
        path = urllib.parse.urlparse(uri).path if scheme == "file" else uri
        _writable_dir(path, "log.mlflow_tracking_uri", "MLflow cannot write its store to")
    elif scheme == "sqlite":
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:":
            _writable_dir(os.path.dirname(os.path.abspath(path)), "log.mlflow_tracking_uri",
                          "MLflow cannot write its database to")


def _mlflow_refuses_file_store() -> bool:
    try:
        from mlflow import environment_variables as env
    except ImportError:
        return False
    allow = getattr(env, "MLFLOW_ALLOW_FILE_STORE", None)
    return allow is not None and not allow.get()


def _writable_dir(path: str, key: str, what: str) -> None:
    """`path` is a folder a file can be written to, or can be created as one; probed with
    a temporary file in it (or in its nearest existing parent), so nothing is left."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(0, "it is a file, not a folder" if probe == os.path.abspath(
                path) else f"{probe} is a file, not a folder")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        reason = e.strerror or first_line(e)
        raise ConfigError(key, f"{what} {path}: {reason}; free that path, make it "
                               "writable, or drop the writer from log.writers") from None


def setup_error(name: str, e: BaseException) -> ConfigError:
    """The one line for writer `name` that raised while opening (after `check`)."""
    key = "log.mlflow_tracking_uri" if name == "mlflow" else "log.writers"
    text = first_line(e)
    if name == "mlflow" and "MLFLOW_ALLOW_FILE_STORE" in str(e):
        text = _FILE_STORE_FIX
    return ConfigError(key, f"the {name} writer could not start: {text}")
