"""tests/durations.json: each test file's seconds in a pytest run, read from its JUnit XML (tools/test.sh writes
build/junit.xml), and each notebook's (tools/test_notebooks.py writes build/notebook_times.json). The suite's two
workers take whole files (`--dist loadfile`), longest first (tests/conftest.py), as the notebooks' two processes do
(tools/test_notebooks.py): a long file started last would run alone while the other worker idles. Only the order
depends on these figures.

    python tools/test_durations.py [build/junit.xml]"""
import collections, json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def file_seconds(junit: Path) -> dict[str, float]:
    "Seconds per test file (setup, call and teardown of its tests) in a JUnit XML report."
    s = collections.Counter()
    for case in ET.parse(junit).getroot().iter('testcase'):
        module = (case.get('classname') or '').split('.')
        if module[0] == 'tests' and len(module) > 1: s[f'tests/{module[1]}.py'] += float(case.get('time') or 0)
    return {f: round(t, 1) for f, t in sorted(s.items(), key=lambda kv: -kv[1])}


if __name__ == '__main__':
    report = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / 'build' / 'junit.xml'
    seconds = file_seconds(report)
    notebooks = ROOT / 'build' / 'notebook_times.json'
    if notebooks.exists(): seconds |= json.loads(notebooks.read_text())
    (ROOT / 'tests' / 'durations.json').write_text(json.dumps(seconds, indent=0) + '\n')
    print(f'tests/durations.json: {len(seconds)} files, {sum(seconds.values()):.0f} s in all')
