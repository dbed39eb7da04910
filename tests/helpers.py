"""Helpers shared by the test modules (pytest puts tests/ on sys.path: `from helpers import run_cfg`)."""


def run_cfg(model_path, run_dir, **overrides) -> dict:
    """A small training config: one worker, a global batch of 8 single-row micro-batches, one constant-LR step, a
    jsonl tracker and no HF export. `section__key=value` overrides (e.g. `optim__lr=1e-3`) set one key each."""
    cfg = {'model': {'path': str(model_path)},
           'optim': {'lr': 1e-2, 'schedule': 'constant'},
           'train': {'global_batch_size': 8, 'micro_batch_size': 1, 'num_steps': 1},
           'placement': {'workers_per_node': 1}, 'checkpoint': {'run_dir': str(run_dir), 'export_hf': False},
           'logging': {'trackers': ['jsonl']}}
    for k, v in overrides.items():
        section, key = k.split('__')
        cfg.setdefault(section, {})[key] = v
    return cfg


def trained_runs(ex, tok) -> list[str]:
    "The decoded runs of consecutive trained tokens of an example."
    runs, cur = [], []
    for i, m in zip(ex.input_ids, ex.loss_mask):
        if m: cur.append(i)
        elif cur: runs.append(tok.decode(cur)); cur = []
    return runs + ([tok.decode(cur)] if cur else [])
