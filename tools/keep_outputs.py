"""Run a notebook and keep the outputs of the cells named: the cheap, deterministic example cells a reader should see
on GitHub without running anything. Other cells keep what they had (nothing, after `nbdev_clean`).

    python tools/keep_outputs.py nbs/05a_dataplan.ipynb 1a2b3c4d 5e6f7a8b

Only text and HTML results are kept (no stderr, no widget state, no execution counts), so a re-run that computes the
same values writes the same file."""
import copy, json, sys
from pathlib import Path
import nbformat
from nbclient import NotebookClient

KEEP = ('text/plain', 'text/html', 'text/markdown')

def clean(out: dict) -> dict | None:
    if out['output_type'] == 'stream': return out if out.get('name') == 'stdout' else None
    if out['output_type'] in ('execute_result', 'display_data'):
        data = {k: v for k, v in out.get('data', {}).items() if k in KEEP}
        if not data: return None
        res = {'output_type': out['output_type'], 'data': data, 'metadata': {}}
        if out['output_type'] == 'execute_result': res['execution_count'] = None
        return res
    return None

def main(path: str, ids: list[str]):
    p = Path(path)
    nb = nbformat.read(p, as_version=4)
    run = copy.deepcopy(nb)
    NotebookClient(run, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(p.parent)}}).execute()
    by_id = {c.get('id'): c for c in run.cells}
    raw = json.loads(p.read_text())
    missing = [i for i in ids if i not in by_id]
    if missing: sys.exit(f'no cell with id {missing} in {p}')
    for c in raw['cells']:
        if c.get('id') in ids:
            c['outputs'] = [o for o in (clean(dict(o)) for o in by_id[c['id']].get('outputs', [])) if o is not None]
            c['execution_count'] = None
    p.write_text(json.dumps(raw, indent=1, ensure_ascii=False) + '\n')
    print(f'{p}: kept the outputs of {len(ids)} cells')

if __name__ == '__main__': main(sys.argv[1], sys.argv[2:])
