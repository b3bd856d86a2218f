"""The persistent compilation cache across processes: a 2-process run started a second
time compiles nothing in any process. On XLA:CPU each process's cache key is its own,
and JAX writes entries from process 0 only, so without jtrain's writer the other
process compiled every program at every start (and process 0 waited for it in the
first collective); jtrain.observe.compiles lets each process write its own entries."""

import launching

STEPS = ["--config.total_steps=2", "--config.checkpoint.every_steps=2"]


def _run(cwd, workdir):
    proc = launching.start(["bash", launching.LAUNCH / "local.sh", "2", *launching.TINY,
                            *STEPS, f"--workdir={workdir}", "--config.compile.cache_dir=xla"],
                           cwd, PORT=str(launching.free_port()),
                           JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    code, out, err = launching.finish(proc)
    assert code == 0, err[-3000:]
    log = (cwd / workdir / "train.log").read_text()
    return log.count("PERSISTENT COMPILATION CACHE MISS"), log.count("cache hit for")


def test_a_second_two_process_run_compiles_nothing_in_either_process(tmp_path):
    cwd = launching.user_dir(tmp_path)
    misses, _ = _run(cwd, "runs/a")
    assert misses > 0  # a fresh cache: both processes compiled (and wrote) every program
    entries = sorted(p.name for p in (cwd / "xla").iterdir())
    misses, hits = _run(cwd, "runs/b")
    assert misses == 0 and hits > 0, (misses, hits)  # process 1's entries are read back
    assert sorted(p.name for p in (cwd / "xla").iterdir()) == entries
