"""The command line: SIGTERM saves at a step boundary, a refused run keeps the earlier run's record, bad YAML and
empty data named. Signals go to real `sft-nb` processes; the rest runs the CLI in this process (`helpers.cli`)."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import nbformat
import pytest
import yaml
from helpers import cli, local_run
from sft_nb.demo_data import identity_rows
from sft_nb.config import load_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'HF_HUB_OFFLINE': '1'}
SFT_NB = str(Path(sys.executable).parent / 'sft-nb')


def train_losses(run_dir):
    return [(m['step'], m['loss']) for m in map(json.loads, (run_dir / 'metrics.jsonl').read_text().splitlines()) if m['kind'] == 'train']


def test_sigterm_saves_at_the_next_step_and_resumes_exactly(tmp_path, ray_session):
    """`sft-nb train`: SIGTERM saves at the next step boundary (exit 143, naming it); resumed losses equal an unstopped run's.
    The signalled command is a real process; the resume goes through the CLI in this process, the unstopped run is `local_run`."""
    args = [ROOT / 'examples' / 'tiny.yaml', 'train.num_steps=15', 'checkpoint.export_hf=false', 'logging.trackers=[jsonl]',
            'data.eval={}', f'placement.ray_address={ray_session}']
    p = subprocess.Popen([SFT_NB, 'train', *map(str, args), f'checkpoint.run_dir={tmp_path / "cut"}'], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / 'cut' / 'metrics.jsonl'
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-3000:])
    done = train_losses(tmp_path / 'cut')
    step = done[-1][0]
    assert 3 <= step < 15 and [s for s, _ in done] == list(range(1, step + 1))
    assert f"stopped by SIGTERM at step {step} of 15; checkpoint {tmp_path / 'cut' / 'checkpoints' / f'step_{step:06d}'}" in err
    assert 'checkpoint.resume=latest' in err
    code, _, err = cli('train', *args, f'checkpoint.run_dir={tmp_path / "cut"}', 'checkpoint.resume=latest')
    assert code == 0, err[-3000:]
    straight = local_run(load_config(args[0], [*map(str, args[1:-1]), f'checkpoint.run_dir={tmp_path / "straight"}']), None)[0]  # 1 rank, here
    assert train_losses(tmp_path / 'cut') == [(k + 1, m['loss']) for k, m in enumerate(straight)]  # resume is exact (DESIGN: resume contract)


def test_refused_run_keeps_the_earlier_record_in_run_words_and_overwrite_leaves_nothing_old(tmp_path):
    """A refused second `sft-nb run` keeps R/<notebook>.ipynb, the earlier run's record (its own goes to <notebook>.failed.ipynb)
    and says how to go on in `sft-nb run`'s words (-p resume latest, -p overwrite true); `-p overwrite true` leaves nothing of the old run."""
    claim = ("from pathlib import Path\nfrom sft_nb.checkpoint import Checkpointer\nfrom sft_nb.config import CheckpointConfig\n"
             "ck = Checkpointer(CheckpointConfig(run_dir=run_dir, resume=resume or None, overwrite=overwrite)); ck.claim()\n"
             "(Path(run_dir) / 'metrics.jsonl').write_text(f'{{\"overwrite\": {overwrite}}}\\n'); ck.release()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("resume = ''\noverwrite = False\nrun_dir = '.'", metadata={'tags': ['parameters']}),
                                         nbformat.v4.new_code_cell(claim)])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    src = tmp_path / 'job.ipynb'
    nbformat.write(nb, src)
    run = tmp_path / 'R'
    assert cli('run', src, '--run-dir', run)[0] == 0
    record = (run / 'job.ipynb').read_bytes()
    code, _, err = cli('run', src, '--run-dir', run)
    assert code == 1 and 'already holds a run (metrics.jsonl); continue it with -p resume latest, start over with -p overwrite true' in err, err
    assert 'checkpoint.resume=latest' not in err and f"the earlier run's record {run / 'job.ipynb'} is kept" in err
    assert (run / 'job.ipynb').read_bytes() == record and (run / 'job.failed.ipynb').exists()
    assert cli('run', src, '-p', 'overwrite', 'true', '--run-dir', run)[0] == 0  # a run that succeeds is the new record
    assert sorted(p.name for p in run.iterdir()) == ['job.ipynb', 'metrics.jsonl'] and 'True' in (run / 'metrics.jsonl').read_text()
    assert (run / 'job.ipynb').read_bytes() != record


def test_yaml_errors_name_the_override_and_the_file(tmp_path):
    "YAML errors in CLI overrides and in `sft-nb run -f` files are one line naming the override or the file, no traceback."
    code, _, err = cli('train', ROOT / 'examples' / 'tiny.yaml', 'optim.lr=[1,')
    assert code == 2 and "override 'optim.lr=[1,': the value of optim.lr is not valid YAML" in err, err
    assert 'Traceback' not in err
    bad = tmp_path / 'params.yaml'
    bad.write_text('max_steps: [3\n')
    code, _, err = cli('run', ROOT / 'examples' / 'train.ipynb', '-f', bad, '--run-dir', tmp_path / 'run')
    assert code == 2 and f"-f {bad}: not valid YAML" in err and 'Traceback' not in err, err


def test_no_usable_rows_lists_rows_and_reasons(tmp_path):
    "'no usable rows' in `sft-nb train` lists the rows and their reasons (a CLI user has no trainer.data_report)."
    data = tmp_path / 'rows.jsonl'
    data.write_text('\n'.join(json.dumps({'messages': [{'role': 'wizard', 'content': 'x'}, {'role': 'assistant', 'content': 'y'}]})
                              for _ in range(3)) + '\n')
    cfg = tmp_path / 'cfg.yaml'
    cfg.write_text(yaml.safe_dump({'model': {'path': 'tiny'}, 'data': {'train': [{'path': str(data)}]},
                                   'checkpoint': {'run_dir': str(tmp_path / 'run')}}))
    code, _, err = cli('train', cfg)
    assert code == 2, err[-3000:]
    assert "no usable rows after tokenization: 3 of 3 rows dropped (bad_format 3): row 0: bad_format: message 0: unknown role 'wizard'" in err
    assert 'has no rows; mixing the others' not in err


def test_sigterm_in_sft_nb_run_saves_at_the_next_step(tmp_path, ray_session):
    """`sft-nb run`: on SIGTERM the kernel's trainer saves at the next step boundary (papermill does not shut the kernel down
    first), the command exits 143 naming the checkpoint, and `-p resume latest` continues to the same losses as a run that
    was never stopped: the config the notebook built (its run's config.yaml) on the notebook's rows, one rank in this
    process (`local_run`, exact against a Ray worker as in the `sft-nb train` test above)."""
    nb = ROOT / 'examples' / 'train.ipynb'
    params = ['-p', 'max_steps', '15', '-p', 'export_hf', 'False', '-p', 'eval_samples', '0', '-p', 'ray_address', ray_session]
    cut = tmp_path / 'cut'
    p = subprocess.Popen([SFT_NB, 'run', nb, *params, '--run-dir', cut], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = cut / 'metrics.jsonl'
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None and not (metrics.exists() and len(train_losses(cut)) >= 3):
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None: p.kill(); p.wait(60)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-3000:])
    done = train_losses(cut)
    step = done[-1][0]
    assert 3 <= step < 15 and [s for s, _ in done] == list(range(1, step + 1))
    ck = cut / 'checkpoints' / f'step_{step:06d}'
    assert f"sft-nb run: stopped by SIGTERM at step {step} of 15; checkpoint {ck}" in err and '-p resume latest' in err, err[-3000:]
    assert json.loads((ck / 'trainer_state.json').read_text())['global_step'] == step
    cfg = load_config(cut / 'config.yaml', [f'checkpoint.run_dir={tmp_path / "straight"}'])
    code, _, err = cli('run', nb, *params, '-p', 'resume', 'latest', '--run-dir', cut)
    assert code == 0, err[-3000:]
    straight = local_run(cfg, identity_rows()['train'])[0]  # train.ipynb without train_data trains on the identity rows
    assert train_losses(cut) == [(k + 1, m['loss']) for k, m in enumerate(straight)]


def test_a_signal_swallowed_in_setup_stops_the_command_where_setup_ends(tmp_path, monkeypatch):
    """A signal in setup raises at once where the main thread is; where that is inside a library's `except Exception`
    (an import probe), the raise is lost and setup goes on. The command then stops where setup ends, said as a stop during
    setup: nothing trained, no run left (CI saw a real `sft-nb train` signalled in its imports go through its whole setup
    and say 'stopped by SIGTERM at step 0 of 150')."""
    import sft_nb.config
    from sft_nb.checkpoint import run_outputs
    real = sft_nb.config.load_config
    def swallowing(*args, **kwargs):  # the signal meets code that swallows whatever it raises
        try: os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)
        except Exception: pass
        return real(*args, **kwargs)
    monkeypatch.setattr(sft_nb.config, 'load_config', swallowing)
    rd = tmp_path / 'run'
    code, _, err = cli('train', ROOT / 'examples' / 'tiny.yaml', 'placement.in_process=true', 'checkpoint.export_hf=false',
                       'logging.trackers=[jsonl]', f'checkpoint.run_dir={rd}')
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert 'sft-nb train: stopped by SIGTERM outside a training step, during setup' in err and 'run the same command again' in err, err[-3000:]
    assert not rd.exists() or run_outputs(rd) == []


@pytest.mark.parametrize('sig, when', [(signal.SIGTERM, 'imports'), (signal.SIGINT, 'imports'), (signal.SIGTERM, 'setup')])
def test_signal_before_the_first_step_stops_named_and_leaves_no_run(tmp_path, sig, when):
    """SIGTERM/SIGINT in `sft-nb train` before the first step (imports, loading, tokenization, Ray's start) exits 128 + signum
    with a message saying nothing was trained (no traceback), and leaves a run folder that holds no run (the next command
    is not refused)."""
    from sft_nb.checkpoint import run_outputs
    rd = tmp_path / 'run'
    p = subprocess.Popen([SFT_NB, 'train', ROOT / 'examples' / 'tiny.yaml', 'train.num_steps=150', 'checkpoint.export_hf=false',
                          'logging.trackers=[jsonl]', f'checkpoint.run_dir={rd}'], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    if when == 'imports': time.sleep(1.5)
    else:  # the run folder is claimed: setup has begun, and the tokenizer, tokenization and Ray's start (seconds) follow. Not a
        # fixed wait after it: on a loaded machine a fixed sleep can outlast the whole setup, and the signal would meet step 0
        while time.time() < deadline and p.poll() is None and not rd.exists(): time.sleep(0.02)
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, (p.returncode, err[-3000:])
    assert f"sft-nb train: stopped by {sig.name} outside a training step, during setup" in err and 'run the same command again' in err, err[-3000:]
    assert 'Traceback' not in err and (not rd.exists() or run_outputs(rd) == [])
