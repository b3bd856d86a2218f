"""Host-side run control; reads nothing from devices.

    signals   SIGTERM / SIGINT -> stop after the current step, on every process (Stopper)
    record    the run-control record every checkpoint carries (RunControl)
    faults    faults on purpose (debug.faults, once per run) and the test-only JTRAIN_FAULT
    watchdog  a step, eval or save past watchdog.timeout_s -> stacks dumped, exit 5 (Watchdog)
    rule      the rule protocol (Rule, Action): built-in rules and a user's callbacks
    monitors  early stopping, plateau, loss-spike and best-value trackers, JSON state
    divergence  the divergence warning (log.divergence_warning): once, JSON state
    decide    the loop's decisions after each step and eval, the same on every process
    memory    memory planning: the grad_accum_steps whose compiled step fits memory.budget_bytes
    ledger    the skip ledger: skipped steps and their example indices (WORKDIR/skipped.jsonl)
"""

from jtrain.control.rule import Action, Rule
from jtrain.control.record import RunControl, versions, writer_run_ids
from jtrain.control.signals import SYNC_EVERY, Stopper, StopRequested
from jtrain.control.watchdog import Watchdog, effective_timeout

__all__ = ["Action", "Rule", "RunControl", "SYNC_EVERY", "StopRequested", "Stopper", "Watchdog",
           "effective_timeout", "versions", "writer_run_ids"]
