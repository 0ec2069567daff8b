"""The README's "What is checked" numbers, produced by the tests themselves.

tests/test_bad_input.py and tests/test_kill_resume.py record what they tried in tests/checked.json
when every case of theirs passed; `render()` turns that file into the README block between
`<!-- checked:begin -->` and `<!-- checked:end -->`; tests/test_checked_block.py fails while the
README block differs from it. Regenerate the block with

    .venv/bin/python tests/_checked.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ROOT / "tests" / "checked.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- checked:begin -->", "<!-- checked:end -->"


def load() -> dict:
    return json.loads(CHECKED.read_text()) if CHECKED.is_file() else {}


def record(section: str, payload: dict) -> None:
    """Set one section of tests/checked.json (atomically: temp file, fsync, rename)."""
    data = load()
    data[section] = payload
    tmp = CHECKED.with_name(f".{CHECKED.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, CHECKED)


def render(data: dict) -> str:
    import textwrap

    lines = [BEGIN, "<!-- generated from tests/checked.json by tests/_checked.py; do not edit by hand -->"]
    items = []
    bad = data.get("bad_input")
    if bad:
        items.append(
            f"{bad['count']} bad inputs tried through the `glm5-bridge` command (`{bad['test']}`): each exits "
            "with status 2 and one stderr line naming the file, key or shape, and leaves no partial output (an "
            f"existing target untouched) and no temporary folder: {', '.join(bad['cases'])};")
    kill = data.get("kill_resume")
    if kill:
        items.append(
            f"{kill['kills']} SIGKILLs at random steps of a {kill['steps']}-step LoRA SFT run (checkpoint every "
            f"{kill['save_every']} steps, `train.deterministic=true`), {kill['resumes']} resumes from the last "
            "checkpoint (a planted half-written checkpoint ignored and removed): loss curve, final loss, LoRA "
            f"weights and optimizer state bit-identical to an uninterrupted run (`{kill['test']}`).")
    for item in items:
        lines += textwrap.wrap(item, 100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    start = text.index(BEGIN)
    return text[start: text.index(END, start) + len(END)]


def update_readme() -> bool:
    """Rewrite the README block from tests/checked.json; True when it changed."""
    text = README.read_text()
    old = readme_block(text)
    if old is None:
        raise SystemExit(f"{README}: no {BEGIN} … {END} block")
    new = render(load())
    if new == old:
        return False
    tmp = README.with_name(f".{README.name}.tmp-{os.getpid()}")
    tmp.write_text(text.replace(old, new, 1))
    os.replace(tmp, README)
    return True


if __name__ == "__main__":
    changed = update_readme()
    print(f"{README}: {'updated' if changed else 'already current'}")
    sys.exit(0)
