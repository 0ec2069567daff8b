"""notebooks/walkthrough.ipynb runs top to bottom (its code cells, in order, in one fresh process)."""

import json
import subprocess
import sys
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "walkthrough.ipynb"


def test_walkthrough_notebook_executes(tmp_path):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    script = tmp_path / "walkthrough.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "walkthrough OK" in proc.stdout
    assert "layer 3: shared top-k from layer 2" in proc.stdout
