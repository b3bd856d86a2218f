"""Host-side run control; reads nothing from devices.

    signals   SIGTERM / SIGINT -> stop after the current step, on every process (Stopper)
    record    the run-control record every checkpoint carries (RunControl)
    changes   config diffs on resume and which keys need checkpoint.allow_changes
    faults    test-only fault injection for --verify_resume (JTRAIN_FAULT)
"""

from jtrain.control.changes import (config_changes, describe_changes, flatten,
                                    unallowed_changes)
from jtrain.control.record import RunControl, versions, writer_run_ids
from jtrain.control.signals import SYNC_EVERY, Stopper, StopRequested

__all__ = ["RunControl", "SYNC_EVERY", "StopRequested", "Stopper", "config_changes",
           "describe_changes", "flatten", "unallowed_changes", "versions", "writer_run_ids"]
