"""The walk-through of docs/guide/user-models.md ("A walk-through"), executed as written: its
`# file:` blocks are written into an empty directory and its `# run:` commands run there, one
by one, as a user types them (relative paths, no test helpers, the user's module on
PYTHONPATH=. only)."""

import json
import re
import shlex
from pathlib import Path
from journey import run_python

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "user-models.md"


def walkthrough():
    text = PAGE.read_text()
    section = text[text.index("## A walk-through"):]
    section = section.split("\n## ", 1)[0]
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", section, re.S):
        first, _, rest = body.partition("\n")
        if first.startswith("# file: "):
            files[first[len("# file: "):].strip()] = rest
        elif lang == "bash" and first.startswith("# run:"):
            commands += [ln for ln in rest.splitlines() if ln.strip()]
    return files, commands


def test_readme_walkthrough_runs_as_written(tmp_path):
    files, commands = walkthrough()
    assert set(files) == {"heads.py", "heads_config.py"} and len(commands) == 4, commands
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "python"
        p = run_python(tmp_path, *argv[1:])
        assert p.returncode == 0, (command, p.stderr[-3000:])
        assert "Traceback" not in p.stderr, (command, p.stderr[-3000:])
        outputs.append(p.stdout + p.stderr)
    pretrain, _, finetune, export = outputs
    assert "compute bfloat16" in pretrain, pretrain[-3000:]
    eval_line = [ln for ln in pretrain.splitlines() if "eval at step 200" in ln][-1]
    assert " recon " in eval_line and " cls " in eval_line, eval_line
    summary = json.loads((tmp_path / "runs/heads/summary.json").read_text())
    assert summary["eval/accuracy"] > 0.85  # the heads learned (labels: sign of x0 + x1)
    report = next((tmp_path / "runs/heads").glob("eval_*.json"))
    report = json.loads(report.read_text())
    assert "eval/recon" in report["metrics"]
    assert report["classification_report"]["accuracy"] == report["metrics"]["eval/accuracy"]
    assert re.search(r"trainable [\d,]+ params .* frozen", finetune), finetune[-3000:]
    assert "LoRA" in finetune
    assert (tmp_path / "exports/lora/params.safetensors").exists()
    assert "LoRA merged" in export, export[-2000:]
