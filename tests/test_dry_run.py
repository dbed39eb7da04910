"""SFTTrainer.dry_run (the memory dry run) on 2 gloo ranks under Ray: what its step adds to each rank's memory covers
what a real step adds (host RSS, VmHWM reset through /proc/self/clear_refs on both; the dry run steps as a later step,
holding Adam's state, 2 MiB for the tiny model), the weights come back bitwise, the next real
step's loss is that of a run without the dry run, and a memory cap below the peak is told what to change before any
step is taken."""
import torch
from sft_nb.trainer import SFTTrainer
from sft_nb.memory import rank_now
from helpers import run_cfg

GiB = 1024**3


def cfg(tiny_path, run_dir):
    "Synthetic full-length rows: every micro-batch of the first step is the plan's largest (2 ranks × 1 micro-batch of 4 × 256)."
    return run_cfg(tiny_path, run_dir, data__synthetic_rows=16, tokenize__max_length=256, train__global_batch_size=8,
                   train__micro_batch_size=4, train__num_steps=2, placement__workers_per_node=2, optim__lr=1e-3)


def first_step_peaks(t) -> tuple[dict, list[dict]]:
    "The first real step's metrics and per-rank memory, measured as `dry_run` measures it."
    start = t.backend.run(rank_now, True)
    m = t.step()
    return m, [{**e, 'before': s['rss']} for s, e in zip(start, t.backend.run(rank_now))]


def test_dry_run_peaks_weights_and_next_step(tiny_path, tmp_path, ray_session):
    """What the dry run's step adds to each rank's memory covers what a real step adds (a real step after it stays within
    30% of a step of its peak; no more than 1.5x a first step's in another process), the weights come back bitwise, the
    next step's loss is bitwise that of a run without a dry run; a cap at half the peak is told what to change before
    any step."""
    with SFTTrainer(cfg(tiny_path, tmp_path / 'plain')) as t:
        m_ref, mem_ref = first_step_peaks(t)
    with SFTTrainer(cfg(tiny_path, tmp_path / 'dry')) as t:
        w0 = t.group.call('full_state')[0]
        r = t.dry_run()
        capped = t.dry_run(memory_limit=max(d['peak'] for d in r['ranks']) // 2)
        assert t.global_step == 0 and not t.step_metrics  # told before training starts
        w1 = t.group.call('full_state')[0]
        m, mem = first_step_peaks(t)
    assert r['fits'] and r['message'].startswith('fits: ') and r['shape'] == (4, 256), r
    assert {d['capacity_from'] for d in r['ranks']} == {'MemAvailable / 2 ranks on the host'}  # both ranks share this machine
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)  # bitwise
    assert m['loss'] == m_ref['loss'] and m['grad_norm'] == m_ref['grad_norm'], (m, m_ref)  # same process layout: bitwise
    for d, a, b in zip(r['ranks'], mem_ref, mem):
        print(f"rank {d['rank']}: dry-run peak {d['peak'] / 2**20:.1f} MiB (step adds {(d['peak'] - d['before']) / 2**20:.1f}), "
              f"first real step {a['peak'] / 2**20:.1f} MiB (adds {(a['peak'] - a['before']) / 2**20:.1f}) without a dry run, "
              f"{b['peak'] / 2**20:.1f} MiB (adds {(b['peak'] - b['before']) / 2**20:.1f}) after it; "
              f"capacity {d['capacity'] / GiB:.1f} GiB ({d['capacity_from']})")
        # The process's baseline (~450 MiB of torch and the model) dominates a peak, so a peak within 10% of another says
        # nothing about the step; what the step adds above the baseline (~50 MiB here) is compared instead.
        adds = a['peak'] - a['before']
        # Counted too little: in the same process, on the same heap, the real step after the dry run needs memory the dry
        # run did not count (measured: 3 MiB over it, a step's 6%; a dry run of half the batch: about half a step).
        assert b['peak'] - d['peak'] <= 0.3 * adds, (d, b)
        # Counted too much: what the dry run's step adds, against what a first real step adds in another process. Not
        # the other way: the dry run's own baseline is higher by the heap its set-up left free and its step reuses
        # (measured: 54.0 vs 51.0 MiB, 54.3 vs 52.9; on a loaded machine 29.2 vs 51.3).
        assert d['peak'] - d['before'] <= 1.5 * adds, (d, a)
    assert_says_what_to_change(capped)


def assert_says_what_to_change(r):
    "A memory cap below the peak: does not fit, and the message names the config keys to change."
    assert not r['fits'] and all(d['capacity_from'] == 'memory_limit' for d in r['ranks'])
    msg = r['message']
    print(msg)
    assert msg.startswith('does not fit: rank ')
    for key in ('train.micro_batch_size=4', "model.activation_checkpointing='none'", 'tokenize.max_length=256', 'placement.workers_per_node'):
        assert key in msg, key


def test_cli_train_dry_run(tiny_path, tmp_path, ray_session, capsys):
    "`sft-nb train CONFIG --dry-run`: the verdict on stdout, exit 0 when it fits, nothing trained or saved."
    import pytest, yaml
    from sft_nb.cli import main
    path = tmp_path / 'cfg.yaml'
    path.write_text(yaml.safe_dump(cfg(tiny_path, tmp_path / 'cli')))
    with pytest.raises(SystemExit) as e: main(['train', str(path), '--dry-run'])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith('fits: rank ')
    assert not (tmp_path / 'cli' / 'checkpoints').exists() or not any((tmp_path / 'cli' / 'checkpoints').iterdir())


def test_panel_button_runs_the_dry_run(tiny_path, tmp_path, ray_session):
    "The panel's Dry run button calls trainer.dry_run in its thread; the verdict is in the status line and the output area; no step is taken."
    from sft_nb.live import TrainerPanel
    with SFTTrainer(cfg(tiny_path, tmp_path / 'panel')) as t:
        calls = []
        real = t.dry_run
        t.dry_run = lambda: calls.append(real()) or calls[-1]  # the button's call, and what it returned
        panel = TrainerPanel(t)
        panel.dry_button.click(); panel.wait(300)
        assert len(calls) == 1 and calls[0]['fits'] and t.global_step == 0 and not t.step_metrics
        assert 'dry run: fits' in panel.status.value, panel.status.value
        assert f"dry run: {calls[0]['message']}" in panel.log.text and 'rank 1: peak ' in panel.log.text
        assert not panel.dry_button.disabled


def test_papermill_dry_run_parameter_stops_after_the_dry_run(tmp_path, ray_session):
    "`sft-nb run examples/train.ipynb -p dry_run true -p estimate_gpus 8`: the estimate for 8 GPUs printed, the verdict printed and in dry_run.json, then nothing trained, evaluated or saved."
    import json
    from pathlib import Path
    import nbformat
    from helpers import cli
    root, run = Path(__file__).resolve().parents[1], tmp_path / 'nb'
    code, _, err = cli('run', root / 'examples' / 'train.ipynb', '-p', 'dry_run', 'true', '-p', 'max_steps', '3', '-p', 'workers_per_node', '2',
                       '-p', 'ray_address', ray_session, '-p', 'estimate_gpus', '8', '-p', 'estimate_gpu_memory', '40', '--run-dir', run)
    assert code == 0, err[-3000:]
    verdict = json.loads((run / 'dry_run.json').read_text())
    assert verdict['fits'] and len(verdict['ranks']) == 2, verdict
    out = '\n'.join(o.get('text', '') for c in nbformat.read(run / 'train.ipynb', as_version=4).cells for o in c.get('outputs', []))
    assert verdict['message'] in out
    assert '8 ranks (cuda)' in out and '(--gpu-memory 40 GiB)' in out and 'fits: rank 0 peaks at' in out  # the estimate cell, before setup
    assert not (run / 'summary.json').exists() and not (run / 'checkpoints').exists() and not (run / 'hf').exists()
    metrics = run / 'metrics.jsonl'
    assert not metrics.exists() or not [l for l in metrics.read_text().splitlines() if '"train"' in l or '"eval"' in l]
