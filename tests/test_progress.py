"""progress.folder_progress: the bytes of a folder being written, reported without the writer's help."""

import re

from glm5_bridge.progress import folder_bytes, folder_progress


def test_folder_progress_reports_what_was_written(tmp_path, capsys):
    out = tmp_path / "weights"
    out.mkdir()
    with folder_progress(out, 3 * 2**20, "saving", interval=0.01):
        for i in range(3):
            (out / f"shard_{i}").write_bytes(b"\0" * 2**20)
    assert folder_bytes(out) == 3 * 2**20
    # not a terminal (pytest captures): no bar, one line at the end with what the folder holds
    assert re.fullmatch(r"saving: 0\.00 GiB in \d+\.\d s\n", capsys.readouterr().out)


def test_no_line_when_the_write_fails(tmp_path, capsys):
    try:
        with folder_progress(tmp_path, 10, "saving"):
            raise OSError("disk full")
    except OSError:
        pass
    assert capsys.readouterr().out == ""
