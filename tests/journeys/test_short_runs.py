"""`--config.total_steps=10` works on every shipped config: a warmup that would not end
before the run does is fitted into it (a tenth of the run) with a one-line notice, in a
new config (the given one is unchanged). The run itself on an 80-column terminal:
tests/journeys/test_console_journey.py."""

import importlib.util
from pathlib import Path

import pytest

from jtrain import config as config_lib
from jtrain import optim

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"shipped_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_takes_total_steps_10(path):
    module = _load(path)
    for variant in getattr(module, "VARIANTS", ("",)):
        cfg = module.get_config(variant)
        cfg.total_steps = 10
        warmup = cfg.optim.warmup_steps
        resolved, notices = config_lib.resolve_for_run(cfg)
        assert resolved.total_steps == 10 and resolved.optim.warmup_steps < 10
        schedule = optim.make_schedule(resolved.optim, 10)  # builds: decay ends after warmup
        assert float(schedule(resolved.optim.warmup_steps)) > 0
        assert cfg.optim.warmup_steps == warmup  # the given config is not changed
        if warmup >= 10:
            assert notices == [f"optim.warmup_steps={warmup} does not end before "
                               "total_steps=10: using 1 (a tenth of the run) for this run; "
                               "set optim.warmup_steps below total_steps to choose"]
        else:
            assert notices == []


def test_a_warmup_inside_the_run_is_kept_and_resolve_names_the_key():
    cfg, notices = config_lib.resolve_for_run({"total_steps": 50, "optim": {"warmup_steps": 5}})
    assert cfg.optim.warmup_steps == 5 and notices == []
    with pytest.raises(config_lib.ConfigError, match=r"^optim\.warmup_steps: 10 >= "
                       r"total_steps=10: .*set optim\.warmup_steps below total_steps$"):
        config_lib.resolve({"total_steps": 10, "optim": {"warmup_steps": 10}})
    cfg, _ = config_lib.resolve_for_run({"total_steps": 10}, allow_changes=["optim.lr"])
    assert tuple(cfg.checkpoint.allow_changes) == ("optim.lr",)
