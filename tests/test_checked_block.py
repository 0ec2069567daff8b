"""The README's generated "What is checked" block matches what the tests recorded (tests/checked.json),
and the record matches the tests as they are now. Fix a failure by running the suites that record
(tests/test_bad_input.py, tests/test_kill_resume.py), then `.venv/bin/python tests/_checked.py`."""

import _checked


def test_record_covers_every_current_case():
    import test_bad_input
    import test_kill_resume

    data = _checked.load()
    assert data.get("bad_input", {}).get("cases") == test_bad_input.CASE_IDS, (
        "tests/checked.json is stale: run tests/test_bad_input.py")
    assert data["bad_input"]["count"] == len(test_bad_input.CASES)
    kill = data.get("kill_resume", {})
    assert (kill.get("kills"), kill.get("steps"), kill.get("save_every")) == (
        test_kill_resume.KILLS, test_kill_resume.STEPS, test_kill_resume.SAVE_EVERY), (
        "tests/checked.json is stale: run tests/test_kill_resume.py")
    assert kill["resumes"] == kill["kills"]


def test_readme_block_is_current():
    block = _checked.readme_block(_checked.README.read_text())
    assert block is not None, f"README.md has no {_checked.BEGIN} … {_checked.END} block"
    assert block == _checked.render(_checked.load()), "README block is stale: run .venv/bin/python tests/_checked.py"
