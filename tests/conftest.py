"""Test setup: 8 fake CPU devices for every test (set before JAX starts its backend),
and absl flags marked parsed (grain worker code reads them)."""

import os
import sys

import jax
from absl import flags

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
