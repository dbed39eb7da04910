"""Write README.md from nbs/index.ipynb (nbdev_readme needs Quarto, which we don't install).
Markdown cells are copied; code cells become ```python blocks, followed by their kept printed output as a ```text block;
`#| hide` cells are left out."""
import json, pathlib
root = pathlib.Path(__file__).resolve().parents[1]
nb = json.loads((root / 'nbs' / 'index.ipynb').read_text())
parts = ['<!-- generated from nbs/index.ipynb by tools/make_readme.py: edit the notebook, not this file -->']
for c in nb['cells']:
    src = ''.join(c['source']).strip()
    if not src: continue
    if c['cell_type'] == 'markdown': parts.append(src)
    elif c['cell_type'] == 'code':
        lines = src.splitlines()
        if any(l.strip() in ('#| hide', '#|hide') for l in lines): continue
        parts.append('```python\n' + '\n'.join(l for l in lines if not l.startswith('#|')) + '\n```')
        out = ''.join(''.join(o['text']) for o in c.get('outputs', []) if o.get('name') == 'stdout').strip('\n')
        if out: parts.append('```text\n' + out + '\n```')  # a kept output: what the reader would see
(root / 'README.md').write_text('\n\n'.join(parts) + '\n')
