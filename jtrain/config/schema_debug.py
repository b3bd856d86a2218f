"""The schema's `debug` section: run forensics (WORKDIR/hashes.jsonl, read by `jtrain
diff` and `jtrain replay`). jtrain.config.schema places it after the run-control
sections."""

from __future__ import annotations

from typing import Any

from jtrain.config.fields import F, INF, _resume_safe

DEBUG_SECTIONS: dict[str, Any] = {
    "debug": _resume_safe({  # read by jtrain.observe.hashes (the loop records)
        "hash_every_steps": F(int, 0, (0, INF), "every N steps, record an exact digest of "
                              "the whole train state and the step's example indices in "
                              "WORKDIR/hashes.jsonl (jtrain diff, jtrain replay); 0 = off"),
    }),
}
