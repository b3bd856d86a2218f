"""How many XLA compilations test files cause from an empty compile cache, counted so that
machine load does not change the count (WORKSPACE.md, "The suite's time"):

    python tests/compile_count.py OUT.json tests/engine/test_loop.py "tests/a.py tests/b.py"

Each argument (one file, or several in one pytest session) runs once with `-n 1`, a fresh
XDG_CACHE_HOME (so jtrain's compile cache, `compile.cache_dir=auto`, starts empty for the
pytest process and every process the tests start) and a fresh `--basetemp`. Then:
`programs`, the entries the cache holds (one per distinct program compiled: later
compiles of the same program in any process were cache hits), by function name; and
`run_misses`, the compiles jtrain's own runs reported (`compile/cache_misses` summed over
every summary.json under the basetemp: more than their distinct programs where runs
compiled the same program at the same time, or with the cache off). OUT.json keeps
each argument's result and the programs' keys, so samples can be joined."""

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile


def count(files: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-count-") as tmp:
        env = dict(os.environ, XDG_CACHE_HOME=os.path.join(tmp, "cache"))
        proc = subprocess.run([sys.executable, "-m", "pytest", *files.split(), "-n", "1",
                               "-q", "-p", "no:cacheprovider", "--basetemp",
                               os.path.join(tmp, "bt")], env=env, capture_output=True,
                              text=True)
        folder = os.path.join(tmp, "cache", "jtrain", "xla")
        keys = sorted(n[:-len("-cache")] for n in os.listdir(folder) if n.endswith("-cache")) \
            if os.path.isdir(folder) else []
        misses = 0
        for path in glob.glob(os.path.join(tmp, "bt", "**", "summary.json"), recursive=True):
            with open(path) as f:
                misses += json.load(f).get("compile/cache_misses") or 0
        tail = (proc.stdout.strip().splitlines() or [""])[-1]
    names = collections.Counter(k.rsplit("-", 1)[0] for k in keys)
    return {"programs": len(keys), "run_misses": misses, "rc": proc.returncode,
            "result": tail[-60:], "by_name": dict(names.most_common()), "keys": keys}


def main(out: str, *args: str) -> None:
    results = {}
    if os.path.exists(out):
        with open(out) as f:
            results = json.load(f)
    for files in args:
        results[files] = count(files)
        shown = {k: v for k, v in results[files].items() if k != "keys"}
        print(files, json.dumps(shown), flush=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
