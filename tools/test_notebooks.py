"""Every notebook's tests as `nbdev_test --n_workers N --do_print --timing --flags FLAGS` runs them (nbdev's own
`test_nb` on each notebook, in a pool of N processes), but started longest first. nbdev_test starts them in name order:
the longest (07_workers, 08_trainer, 08e_memory) began late, and the last of them ran alone while the other process
idled. The order comes from tests/durations.json (seconds per notebook from an earlier run; a notebook it lacks counts as
the median); this run's seconds go to build/notebook_times.json, which `python tools/test_durations.py` folds in.

    python tools/test_notebooks.py [--flags slow] [--n_workers 2]"""
import argparse, json, statistics, sys
from pathlib import Path
from fastcore.parallel import parallel
from fastcore.xtras import working_directory
from nbdev.config import get_config
from nbdev.doclinks import nbglob
from nbdev.test import test_nb

ROOT = Path(__file__).resolve().parents[1]


def longest_first(files: list[Path], seconds: dict[str, float]) -> list[Path]:
    "`files` by their seconds in `seconds` (keys: paths from the repo root), longest first; an unknown one counts as the median."
    known = {f: seconds[k] for f in files if (k := f.relative_to(ROOT).as_posix()) in seconds}
    unknown = statistics.median(known.values()) if known else 0
    return sorted(files, key=lambda f: -known.get(f, unknown))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--flags', default='', help='space-separated test flags whose cells run too (settings.ini tst_flags skips them)')
    ap.add_argument('--n_workers', type=int, default=2)
    a = ap.parse_args(argv)
    cfg = get_config()
    files = [f.absolute() for f in nbglob(cfg.nbs_path, as_path=True)]
    if not files: print('No files were eligible for testing'); return 1
    files = longest_first(files, json.loads((ROOT / 'tests' / 'durations.json').read_text()))
    with working_directory(cfg.nbs_path):
        results = parallel(test_nb, files, skip_flags=cfg.tst_flags.split(), force_flags=a.flags.split(),
                           n_workers=a.n_workers, basepath=cfg.config_path, do_print=True, pause=0.01)
    times = {f.relative_to(ROOT).as_posix(): round(t, 1) for f, (_, t) in zip(files, results)}
    (ROOT / 'build').mkdir(exist_ok=True)
    (ROOT / 'build' / 'notebook_times.json').write_text(json.dumps(times, indent=0) + '\n')
    failed = [f.name for f, (ok, _) in zip(files, results) if not ok]
    for name, t in sorted(times.items(), key=lambda kv: -kv[1]): print(f"{Path(name).name}: {int(t)} secs")
    if failed:
        sys.stderr.write('\nnbdev Tests Failed On The Following Notebooks:\n' + '=' * 50 + '\n\t' + '\n\t'.join(failed) + '\n')
        return 1
    print('Success.')
    return 0


if __name__ == '__main__':
    sys.exit(main())
