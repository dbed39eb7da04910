"""Every time the README states (`**26 s**`, `68 s`, `2.5 min`) sits in a paragraph that names, in backticks, the command
that measures it (`make demo`, `python tools/lab_time.py`, `.ci/run`, `time make venv`), and that command exists
here: a make target of the Makefile, or a script of the repository. Pure text: no command is run."""
from __future__ import annotations
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = re.compile(r'\b\d[\d,]*(?:\.\d+)?\s?(?:s|ms|min|minutes|seconds)\b')
COMMAND = re.compile(r'`((?:time )?(?:make [\w-]+|python [\w/.-]+\.py|bash [\w/.-]+|\.ci/run|tools/[\w.-]+\.sh))(?: [^`]*)?`')


def _exists(cmd: str) -> bool:
    "A make target of the Makefile, or a file of the repository."
    cmd = cmd.removeprefix('time ')
    if cmd.startswith('make '):
        return re.search(rf'^{re.escape(cmd.split()[1])}:', (ROOT / 'Makefile').read_text(), re.M) is not None
    return (ROOT / cmd.split()[-1]).is_file()


def timed_paragraphs(text: str) -> list[tuple[list[str], list[str]]]:
    "(timings, measuring commands) of each paragraph (blank-line separated, code blocks left out) that states a time."
    text = re.sub(r'```.*?```', '', text, flags=re.S)
    return [(TIMING.findall(p), COMMAND.findall(p)) for p in re.split(r'\n\s*\n', text) if TIMING.search(p)]


def test_each_readme_timing_names_its_command():
    found = timed_paragraphs((ROOT / 'README.md').read_text())
    assert found, 'the README states no timing'
    for timings, commands in found:
        assert commands, f'{timings}: no measuring command named in its paragraph'
        assert all(_exists(c) for c in commands), commands


def test_the_rule_catches_an_unmeasured_timing():
    bad = timed_paragraphs('The demo takes **370 s** on a laptop.\n\nRun `make demo`.')
    assert bad == [(['370 s'], [])]
    good = timed_paragraphs('Measured with `python tools/lab_time.py` (idle machine): **26 s**.')
    assert good == [(['26 s'], ['python tools/lab_time.py'])] and _exists('python tools/lab_time.py') and not _exists('make nothing')
