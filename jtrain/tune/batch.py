"""`tune.population = K > 1`: up to K trials trained as the members of one population run
(jtrain.engine.population: one vmapped, jitted step), possible when every `tune.space` key is one
a population can vary (jtrain.config.schema_population.VARY_KEYS; checked with the config).

- A batch: the study is asked for up to K new trials, one after another (each sampled
  with the sampler seeded by tune.seed + its number, as for single trials); fewer when
  `tune.trials` runs out. The batch trains in WORKDIR/populations/<first trial number>;
  every member has the run's `seed` and its trial's values (trials that sampled the same
  values share one member). Each trial is told its own member's `tune.monitor`
  (`<monitor>/m<i>`); every eval is reported to the study, and no trial is pruned (the
  members of a population cannot stop one at a time).
- A killed batch: its trials are continued together. The worker that takes the first
  queued continuation claims the batch's other queued continuations, rebuilds the same
  population (every member of the batch, in the same order; those already told train
  along, untold) and resumes it from the batch's newest checkpoint. That is exact when
  one worker runs the study: a worker that finds trials running in another live worker
  stops with one line naming tune.population.
"""

from __future__ import annotations

from optuna.trial import Trial, TrialState

from jtrain import internals
from jtrain.config import space as space_lib
from jtrain.errors import ConfigError
from jtrain.tune import study as study_lib
from jtrain.tune import trial as trial_lib

DIR = "populations"


def unique(params: list[dict]) -> tuple[list[dict], list[int]]:
    """The distinct parameter sets in order, and each entry's index among them."""
    distinct, index = [], []
    for p in params:
        if p not in distinct:
            distinct.append(p)
        index.append(distinct.index(p))
    return distinct, index


def population_config(base: dict, params: list[dict]) -> dict:
    """The run config of a batch: the base config with one member per distinct parameter
    set (all with the run's seed); a plain run when there is one."""
    distinct, _ = unique(params)
    if len(distinct) == 1:
        return trial_lib.trial_config(base, distinct[0])
    config = trial_lib.trial_config(base, {})
    seed = int(config.get("seed", 0))
    config["population"] = {**config.get("population", {}), "size": len(distinct),
                            "seeds": [seed] * len(distinct),
                            "vary": {k: [p[k] for p in distinct] for k in distinct[0]}}
    return config


def monitors(params: list[dict], monitor: str) -> list[str]:
    """Each entry's metric name in its batch's run: `<monitor>/m<member>`."""
    distinct, index = unique(params)
    return [monitor if len(distinct) == 1 else f"{monitor}/m{i}" for i in index]


def check_base(base: dict) -> None:
    """ConfigError naming tune.population when the config cannot train as a population
    (a population run of the space's ends is checked like any config)."""
    from jtrain import config as config_lib

    if int(base.get("population", {}).get("size", 1)) > 1:
        raise ConfigError("tune.population", "the trials are the members of the "
                          "population: leave population.size = 1")
    flat = space_lib.flatten(base["tune"]["space"])
    ends = [{k: spec[1][0] if spec[0] == "choice" else spec[1] for k, spec in flat.items()},
            {k: spec[1][-1] if spec[0] == "choice" else spec[2] for k, spec in flat.items()}]
    try:
        config_lib.resolve(population_config(base, ends))
    except ConfigError as e:
        raise ConfigError("tune.population", f"this config cannot train as a population: "
                          f"{e.key}: {e.why}") from None


def _other_worker(study, ignore=lambda number: False) -> None:
    """ConfigError when a live worker other than this one runs trials of the study."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not ignore(t.number):
            a = t.user_attrs
            raise ConfigError("tune.population", f"trial {t.number} of this study is "
                              f"running in another worker ({a.get(study_lib.HOST, '?')}:"
                              f"{a.get(study_lib.PID, '?')}): with tune.population > 1 one "
                              "worker runs a study at a time (a killed population is "
                              "continued exactly only then); rerun when it is done")


def next_batch(study, tune_cfg, space: dict, workdir: str):
    """([optuna Trial or None per member], Job) for this worker, or (None, None)."""
    study_lib.requeue_orphans(study, tune_cfg.stale_after_s)
    _other_worker(study)
    first = study_lib.next_trial(study, tune_cfg)
    if first is None:
        return None, None
    if study_lib.CONTINUES in first.user_attrs:
        return _continuation(study, first, space, workdir)
    trials, params = [first], [trial_lib.suggest(first, space)]
    while len(trials) < tune_cfg.population and not study.get_trials(
            deepcopy=False, states=(TrialState.WAITING,)):
        t = study_lib.next_trial(study, tune_cfg, requeue=False)
        if t is None:
            break
        if study_lib.CONTINUES in t.user_attrs:  # queued since: the next batch takes it
            internals.optuna_storage(study).set_trial_state_values(
                internals.optuna_trial_id(study, t), TrialState.WAITING)
            break
        trials.append(t)
        params.append(trial_lib.suggest(t, space))
    numbers = [t.number for t in trials]
    try:  # two workers that started together: the later batch gives way
        _other_worker(study, lambda n: n in numbers or n > numbers[0])
    except ConfigError:
        for t in trials:
            t.set_user_attr(study_lib.SURPLUS, True)
            study.tell(t, state=TrialState.FAIL)
        raise
    rel = f"{DIR}/{first.number}"
    for slot, t in enumerate(trials):
        t.set_user_attr(study_lib.WORKDIR, rel)
        t.set_user_attr(study_lib.SLOT, slot)
        t.set_user_attr(study_lib.BATCH, numbers)
    members = [{"number": n, "params": p, "continues": None}
               for n, p in zip(numbers, params, strict=True)]
    _mark_members(trials, members)
    return trials, study_lib.Job(first.number, rel, params[0], members=members)


def _continuation(study, first, space: dict, workdir: str):
    """The killed batch of `first` (a queued continuation), rebuilt whole."""
    storage = internals.optuna_storage(study)
    attrs = first.user_attrs
    rel = attrs[study_lib.WORKDIR]
    batch = attrs.get(study_lib.BATCH) or [attrs[study_lib.CONTINUES]]
    claimed = {attrs.get(study_lib.SLOT, 0): first}
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        slot, tid = t.user_attrs.get(study_lib.SLOT, 0), internals.optuna_trial_id(study, t)
        if t.user_attrs.get(study_lib.WORKDIR) == rel and slot not in claimed and \
                storage.set_trial_state_values(tid, TrialState.RUNNING):
            claimed[slot] = Trial(study, tid)
            study_lib.mark(claimed[slot])
    resumed = trial_lib.last_checkpoint(trial_lib.trial_dir(workdir, rel))
    trials, members = [], []
    for slot, number in enumerate(batch):
        t = claimed.get(slot)
        if t is None:  # told already: trains along, untold
            old = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(
                internals.optuna_study_id(study), number))
            params = trial_lib.checked_params(space, trial_lib.decode(space, old.params),
                                              f"trial {number}")
            members.append({"number": None, "params": params, "continues": None})
            trials.append(None)
            continue
        params = trial_lib.suggest(t, space)
        if resumed is not None:
            t.set_user_attr(study_lib.RESUMED, resumed)
        study_lib.copy_reports(study, t, resumed)
        members.append({"number": t.number, "params": params,
                        "continues": t.user_attrs[study_lib.CONTINUES]})
        trials.append(t)
    numbers = [m["number"] if m["number"] is not None else n
               for m, n in zip(members, batch, strict=True)]
    for t in trials:
        if t is not None:
            t.set_user_attr(study_lib.BATCH, numbers)
    _mark_members(trials, members)
    return trials, study_lib.Job(first.number, rel, members[0]["params"],
                                 attrs[study_lib.CONTINUES], resumed, members=members)


def _mark_members(trials: list, members: list[dict]) -> None:
    _, index = unique([m["params"] for m in members])
    for t, i in zip(trials, index, strict=True):
        if t is not None:
            t.set_user_attr(study_lib.MEMBER, i)


def run(base: dict, job, workdir: str, monitor: str, report=None) -> list:
    """Trains the batch in `workdir`: one Outcome per member. `report(slot, step, value)`
    (process 0 only) gets every eval of every member; nothing is pruned."""
    params = [m["params"] for m in job.members]
    names = monitors(params, monitor)

    def on_eval(step, metrics):
        for slot, name in enumerate(names):
            value = metrics.get(name)
            if report is not None and value is not None:
                report(slot, step, float(value))
        return False

    return trial_lib.train(population_config(base, params), workdir, on_eval, names)
