"""Structure check of the `sft_nb` package and its notebooks; prints one line per violation.

    python tools/structure.py          # exit 1 when anything is reported

Rules (issue 15, item 4; docs/STYLE.md):

- **cycle**: the import graph of `sft_nb` has no cycle. Every `import` / `from ... import` in a module counts,
  at any depth (function-level imports too), and so does a `'sft_nb.x...'` string passed to
  `importlib.import_module` or kept in a backend registry (`BACKENDS`).
- **stage**: a module never imports a module of a higher stage. The stage of a module is the number that
  starts the name of the notebook it is exported from (the `File to edit: ../nbs/NN_x.ipynb` header):
  `02_tokenize` and `02a_templates` are stage 2, `07b1_backends.megatron_compat` is stage 7.
  Letter infixes (`02a`, `07b1`) are insertions into a stage in reading order, not a finer dependency order
  (`07b` uses `07b1`, which was split out of it), so modules of one stage may import each other — acyclically.
- **private**: no name starting with one underscore (not dunders) is imported from another `sft_nb` module,
  nor read as an attribute of an imported `sft_nb` module (`models._atomic_build`), nor called as a method of any
  object but `self` / `cls` (`w._shard(...)`: the memory plan once rebuilt the worker by hand from six of its private
  methods; a caller outside a class uses its public methods, e.g. `FSDPWorker.build`). `os._exit` and other private
  names of imported non-package modules are fine.
- **cell**: no exported notebook cell (`#| export`, `exports`, `exporti`) is over 80 lines, counting every line
  of the cell except its `#|` directives.
- **once**: a rule the package states in one place is not written again elsewhere (`ONCE`): the optimizer is built by
  `sft_nb.optim.adamw` alone, and the workers read their configs as typed dataclasses, never `cfg['key']` or
  `cfg.get('key', default)` on a config dict (a default written twice drifts: the workers once fell back to
  `loss_chunk` 0 where `ModelConfig` says 2048), and the tokens of a packed row come from `SFTConfig.pack_capacity`.

Pure parsing (`ast`, `json`): nothing of `sft_nb` is imported, so a broken module is still checked.
"""
from __future__ import annotations
import ast, json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = 'sft_nb'
MAX_CELL_LINES = 80
_HEADER = re.compile(r'File to edit: (?:\.\./)+nbs/(\S+?\.ipynb)')
_STAGE = re.compile(r'^(\d+)')
_DIRECTIVE = re.compile(r'^\s*#\s*\|\s*([\w-]+)')
EXPORT_DIRECTIVES = {'export', 'exports', 'exporti'}
ONCE = {  # rule → (pattern, the only files allowed to contain it, the files searched)
    'AdamW built outside sft_nb.optim.adamw': (re.compile(r'\boptim\.AdamW\('), {'sft_nb/optim.py'}, 'sft_nb/**/*.py'),
    'a config read as a dict': (re.compile(r'\b(?:mcfg|ocfg|placement)(?:\[|\.get\()'), set(), 'sft_nb/backends/*.py'),
    'the packing capacity rule outside SFTConfig.pack_capacity': (re.compile(r'capacity or \w+\.tokenize\.max_length'), {'sft_nb/config.py'}, 'sft_nb/**/*.py'),
}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    "Dotted module name → file, for every module of the package (generated indexes excluded)."
    out = {}
    for p in sorted((root / PKG).rglob('*.py')):
        if p.name == '_modidx.py' or '.ipynb_checkpoints' in p.parts: continue
        parts = list(p.relative_to(root).with_suffix('').parts)
        if parts[-1] == '__init__': parts = parts[:-1]
        out['.'.join(parts)] = p
    return out


def notebook_of(path: Path) -> str | None:
    "The notebook a generated module says to edit (`None` for hand-written files like `__init__.py`)."
    m = _HEADER.search(path.read_text(encoding='utf-8')[:2000])
    return m.group(1) if m else None


def stage_of(notebook: str | None) -> int | None:
    "`'07b1_backends.megatron_compat.ipynb'` → 7; `None` when the notebook has no number."
    m = _STAGE.match(Path(notebook).name) if notebook else None
    return int(m.group(1)) if m else None


def _resolve(name: str, modules: dict) -> str | None:
    "The longest package module that `name` is or lies inside (`sft_nb.models.tiny_model` → `sft_nb.models`)."
    parts = name.split('.')
    for i in range(len(parts), 0, -1):
        cand = '.'.join(parts[:i])
        if cand in modules: return cand
    return None


def module_imports(mod: str, path: Path, modules: dict) -> list[tuple[str, int, str | None]]:
    "Every `(imported module, line, name)` of the package that `mod` imports; `name` is set for `from m import name`."
    tree = ast.parse(path.read_text(encoding='utf-8'), filename=str(path))
    is_pkg = path.name == '__init__.py'
    base = mod.split('.') if is_pkg else mod.split('.')[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (t := _resolve(a.name, modules)): out.append((t, node.lineno, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[:len(base) - (node.level - 1)]
                src = '.'.join(up + ([node.module] if node.module else []))
            else: src = node.module or ''
            for a in node.names:
                sub = f'{src}.{a.name}'
                if sub in modules: out.append((sub, node.lineno, None))  # `from sft_nb import models`
                elif (t := _resolve(src, modules)): out.append((t, node.lineno, a.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PKG + '.'):
            # `importlib.import_module('sft_nb.x')` or a registry entry 'sft_nb.backends.fsdp:FSDPWorker'
            name = node.value.split(':')[0]
            if re.fullmatch(r'[\w.]+', name) and name in modules: out.append((name, node.lineno, None))
    return [o for o in out if o[0] != mod]


def module_aliases(path: Path, modules: dict, mod: str) -> dict[str, str]:
    "Local names bound to package modules (`from sft_nb import models as m` → {'m': 'sft_nb.models'})."
    tree = ast.parse(path.read_text(encoding='utf-8'))
    is_pkg = path.name == '__init__.py'
    base = mod.split('.') if is_pkg else mod.split('.')[:-1]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules: out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            src = '.'.join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])) if node.level else (node.module or '')
            for a in node.names:
                if f'{src}.{a.name}' in modules: out[a.asname or a.name] = f'{src}.{a.name}'
    return out


def _is_private(name: str) -> bool: return name.startswith('_') and not name.startswith('__')


def private_calls(path: Path, rel, mod: str) -> list[str]:
    "`x._name(...)` calls in a module where `x` is not `self`/`cls` nor a module the file imports (`os._exit`)."
    tree = ast.parse(path.read_text(encoding='utf-8'))
    modules = {(a.asname or a.name).split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_private(node.func.attr)): continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and (owner.id in ('self', 'cls') or owner.id in modules): continue
        out.append(f'private: {rel}:{node.lineno}: {mod} calls {ast.unparse(owner)}.{node.func.attr}() from outside its class')
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    "Module → the package modules it imports."
    mods = module_files(root)
    return {m: {t for t, _, _ in module_imports(m, p, mods)} for m, p in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    "Strongly connected components with more than one module (Tarjan), each sorted."
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index: visit(v)
    return sorted(out)


def exported_cells(root: Path = ROOT) -> list[tuple[str, int, str, list[str], bool]]:
    """`(notebook, position, id, lines, tested)` of every exported notebook cell: its lines without the `#|` directives,
    and whether the next code cell is not exported (the example or test under it)."""
    out = []
    for nb in sorted((root / 'nbs').rglob('*.ipynb')):
        if '.ipynb_checkpoints' in nb.parts: continue
        code = [(i, c) for i, c in enumerate(json.loads(nb.read_text(encoding='utf-8'))['cells']) if c['cell_type'] == 'code']
        exported = [EXPORT_DIRECTIVES & {m.group(1) for l in ''.join(c['source']).splitlines() if (m := _DIRECTIVE.match(l))}
                    for _, c in code]
        for k, (i, c) in enumerate(code):
            if not exported[k]: continue
            lines = [l for l in ''.join(c['source']).rstrip().splitlines() if not _DIRECTIVE.match(l)]
            out.append((str(nb.relative_to(root)), i, c.get('id', ''), lines, k + 1 < len(code) and not exported[k + 1]))
    return out


def long_cells(root: Path = ROOT, limit: int = MAX_CELL_LINES) -> list[tuple[str, str, int]]:
    "`(notebook, cell, lines)` of every exported cell over `limit` lines; cell = its 0-based position and id."
    return [(nb, f"{i}" + (f" (id {id})" if id else ''), len(lines)) for nb, i, id, lines, _ in exported_cells(root) if len(lines) > limit]


def said_twice(root: Path = ROOT) -> list[str]:
    "Every line that writes again what `ONCE` keeps in one place."
    out = []
    for rule, (pat, allowed, glob) in ONCE.items():
        for f in sorted(root.glob(glob)):
            rel = str(f.relative_to(root))
            if rel in allowed or f.name == '_modidx.py': continue
            out += [f'once: {rel}:{i}: {rule}' for i, l in enumerate(f.read_text(encoding='utf-8').splitlines(), 1) if pat.search(l)]
    return out


def violations(root: Path = ROOT) -> list[str]:
    "Every violation of the rules, one readable line each."
    mods = module_files(root)
    stage = {m: stage_of(notebook_of(p)) for m, p in mods.items()}
    out, graph = [], {}
    for m, p in mods.items():
        rel = p.relative_to(root)
        imps = module_imports(m, p, mods)
        graph[m] = {t for t, _, _ in imps}
        for t, line, name in imps:
            if stage[m] is not None and stage[t] is not None and stage[t] > stage[m]:
                out.append(f'stage: {rel}:{line}: {m} (stage {stage[m]:02d}) imports {t} (stage {stage[t]:02d})')
            if name and _is_private(name):
                out.append(f'private: {rel}:{line}: {m} imports {name} from {t}')
        aliases = module_aliases(p, mods, m)
        for node in ast.walk(ast.parse(p.read_text(encoding='utf-8'))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _is_private(node.attr) and aliases[node.value.id] != m):
                out.append(f'private: {rel}:{node.lineno}: {m} reads {aliases[node.value.id]}.{node.attr}')
        out += private_calls(p, rel, m)
    for comp in find_cycles(graph): out.append(f'cycle: {" <-> ".join(comp)}')
    for nb, i, n in long_cells(root): out.append(f'cell: {nb} cell {i}: exported cell of {n} lines (max {MAX_CELL_LINES})')
    out += said_twice(root)
    return sorted(set(out), key=lambda s: (s.split(':')[0], s))


def main(argv=None) -> int:
    vs = violations()
    for v in vs: print(v)
    print(f'{len(vs)} violation(s)', file=sys.stderr)
    return 1 if vs else 0


if __name__ == '__main__': sys.exit(main())
