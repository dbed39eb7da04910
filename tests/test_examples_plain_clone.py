"""The examples run from a plain clone: examples/ copied alone into an empty folder (no ../shared, no nbs/, no tests/),
each notebook executed by papermill on its defaults with that folder as its working directory, using only the
installed package. Users have nothing else beside the examples. train.ipynb joins the session's Ray cluster
(`ray_address`) instead of starting a node of its own: where the files are is what a plain clone tests; a local node
starts as the session's cluster does (`init_ray`, tests/conftest.py)."""
import os, shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def test_every_example_runs_on_its_defaults_from_an_empty_folder(tmp_path, ray_session):
    import papermill
    here = tmp_path / 'clone'
    shutil.copytree(ROOT / 'examples', here)
    assert not any((p / 'shared').exists() for p in here.parents)  # nothing beside it, as a user has
    notebooks = sorted(here.glob('*.ipynb'))
    assert {p.name for p in notebooks} >= {'inspect.ipynb', 'interactive.ipynb', 'lens.ipynb', 'packing.ipynb', 'train.ipynb'}

    def run(nb: Path):
        params = {'ray_address': ray_session} if nb.name == 'train.ipynb' else {}
        try: papermill.execute_notebook(str(nb), str(nb.with_name(f'{nb.stem}.out.ipynb')), cwd=str(here), kernel_name='python3',
                                        parameters=params, progress_bar=False, execution_timeout=600)
        except papermill.PapermillExecutionError as e: return nb.name, f'{e.ename}: {e.evalue}'
        return nb.name, None

    # papermill's `cwd` is a process-wide chdir that each run undoes to what it saw: two runs in threads can leave this
    # process in the clone (later tests' relative paths then fail), so the working directory is put back here
    before = os.getcwd()
    try:
        with ThreadPoolExecutor(2) as pool: failed = {n: err for n, err in pool.map(run, notebooks) if err}
    finally: os.chdir(before)
    assert not failed, failed
