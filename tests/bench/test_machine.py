"""What every benchmark records beside its numbers (machine, commit, load) and when a
measurement is marked unreliable; `bench table` on a peers JSON. No timing assertions."""

import json

from jtrain.bench import main as bench_main
from jtrain.bench import machine, peers as bp, table


def test_unreliable_when_any_load_sample_exceeds_the_cores():
    assert not machine.unreliable([0.5, 1.9, 2.0], 2)  # at the core count: still fine
    assert machine.unreliable([0.5, 2.01, 1.0], 2)  # one sample above: unreliable
    assert not machine.unreliable([float("nan")], 2)
    rec = machine.load_record([1.0, 3.5, 1.2], ncores=2)
    assert rec == {"load_before": 1.0, "load_after": 1.2, "load_max": 3.5, "unreliable": True}
    assert machine.load_record([0.1, 0.2], ncores=2)["unreliable"] is False
    assert machine.mark(rec) == "!" and machine.mark({"unreliable": False}) == ""
    line = machine.loads_line([rec, machine.load_record([0.1, 0.2], 2)], ncores=2)
    assert "1 of 2 measurements UNRELIABLE" in line and "0.20-3.50 on 2 cores" in line


def test_load_watch_samples_before_and_after(monkeypatch):
    values = iter([0.5, 4.0, 4.0, 4.0])
    monkeypatch.setattr(machine, "loadavg", lambda: next(values))
    with machine.LoadWatch(thread=False) as watch:
        watch.sample()  # what a caller waiting on a child does once a second
    assert watch.loads == [0.5, 4.0, 4.0]
    assert watch.record["load_before"] == 0.5 and watch.record["load_after"] == 4.0
    assert watch.record["unreliable"] == (4.0 > machine.cores())


def test_machine_record_names_cpu_cores_commit_and_date():
    info = machine.machine()
    assert set(info) >= {"cpu_model", "cores", "commit", "date", "load_at_start"}
    assert info["cores"] >= 1 and info["cpu_model"] and info["commit"]
    assert info["date"][:2] == "20"
    assert "cores" in machine.header_line(info)


def _run(step_ms, load):
    return {"step_ms": step_ms, "wall_s": 10.0, "maxrss_mb": 500.0, "faults": 1000,
            "load": machine.load_record(load, ncores=2), "evals": [(8, 1.0, 2.0)]}


def _peers_json(tmp_path):
    sides = {}
    for side, base in zip(bp.SIDES, (300.0, 200.0, 250.0), strict=True):
        runs = [_run(base, [0.5, 1.0]), _run(base + 10, [0.5, 3.0])]  # round 2: loaded
        sides[side] = {"step_ms": base + 5, "wall_s": 10.0, "final_metric": 2.0,
                       "time_to_target_s": 1.0, "maxrss_mb": 500.0, "faults": 1000,
                       "steps": [8, 8], "runs": runs, "unreliable": True}
    res = {"bench": "peers", "command": "python -m jtrain.bench peers --cases=lm_tiny",
           "machine": {"cpu_model": "Test CPU", "cores": 2, "commit": "abc123",
                       "date": "2026-01-01T00:00:00+00:00", "load_at_start": 0.5},
           "cases": [{"case": "lm_tiny", "steps": 8, "rounds": 2, "metric": "eval/loss",
                      "target": 2.0, "unreliable": True, "sides": sides,
                      "jtrain_command": "python -m jtrain.main"}]}
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(res))
    return path, res


def test_peers_report_and_table_mark_the_loaded_round(tmp_path, capsys):
    path, res = _peers_json(tmp_path)
    text = bp.format_case(res["cases"][0])
    assert "305.00!" in text and "UNRELIABLE" in text  # the printed table
    md = table.markdown(str(path))
    assert "| step ms | 305.00 (300.00, 310.00!) | 205.00 (200.00, 210.00!)" in md
    assert "| 1.488 | 1.196 |" in md  # ratios of the medians
    assert "jtrain `abc123`, Test CPU, 2 cores" in md and "1 of 2" not in md
    assert "3 of 6 measurements UNRELIABLE" in md
    assert bench_main(["table", str(path)]) == 0
    assert capsys.readouterr().out.strip() == md.strip()


def test_table_of_a_foreign_json_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"bench": "console"}')
    assert bench_main(["table", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jtrain: usage error:") and err.count("\n") == 1
    assert bench_main(["table"]) == 2
