"""Batch runs: `sft-nb run` (papermill) and `sft-nb train`, parameter checks, failures, and a real two-node Ray cluster."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN_NB = ROOT / 'examples' / 'train.ipynb'
ENV = {**os.environ, 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'HF_HUB_OFFLINE': '1'}


def sft_nb(*args, cwd=None, timeout=600):
    return subprocess.run([str(Path(sys.executable).parent / 'sft-nb'), *map(str, args)], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def read_run(run_dir):
    summary = json.loads((run_dir / 'summary.json').read_text())
    metrics = [json.loads(l) for l in (run_dir / 'metrics.jsonl').read_text().splitlines()]
    return summary, [m['loss'] for m in metrics if m['kind'] == 'train']


def test_bad_parameter_fails_before_running(tmp_path):
    t0 = time.time()
    r = sft_nb('run', TRAIN_NB, '-p', 'max_stepz', '3', '--run-dir', tmp_path / 'run')
    assert r.returncode != 0 and "unknown parameter 'max_stepz' (did you mean 'max_steps'?)" in r.stderr
    r = sft_nb('run', TRAIN_NB, '-p', 'max_steps', 'lots', '--run-dir', tmp_path / 'run')
    assert r.returncode != 0 and "parameter 'max_steps' expects int, got str 'lots'" in r.stderr
    assert not (tmp_path / 'run' / 'train.ipynb').exists()  # no kernel was started


def test_notebook_parameters_reach_the_config(tmp_path):
    "The tokenize options of issue 14 and checkpoint.overwrite are notebook parameters, listed by papermill and put in the config."
    names = ('history', 'train_on_reasoning', 'train_on_tool_calls', 'overwrite')
    r = subprocess.run([str(Path(sys.executable).parent / 'papermill'), '--help-notebook', str(TRAIN_NB)], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0 and all(f'  {n}: ' in r.stdout for n in names), r.stdout
    cells = nbformat.read(TRAIN_NB, as_version=4).cells
    ns = {}
    exec(next(c.source for c in cells if 'parameters' in c.metadata.get('tags', [])), ns)
    ns.update(history='final', train_on_reasoning=False, train_on_tool_calls=False, overwrite=True, run_dir=str(tmp_path / 'run'))
    exec(next(c.source for c in cells if 'cfg = load_config(' in c.source), ns)  # builds the config and an SFTTrainer (no Ray yet)
    t, ck = ns['cfg'].tokenize, ns['cfg'].checkpoint
    assert (t.history, t.train_on_reasoning, t.train_on_tool_calls, ck.overwrite) == ('final', False, False, True)
    assert '  sequence_parallel: ' in r.stdout  # issue 28: a notebook parameter too
    ns.update(workers_per_node=2, sequence_parallel=2)
    exec(next(c.source for c in cells if 'cfg = load_config(' in c.source), ns)
    assert (ns['cfg'].placement.sequence_parallel, ns['cfg'].placement.dp_size) == (2, 1)


def test_failing_notebook_names_the_cell(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('x = 1', metadata={'tags': ['parameters']}),
                                         nbformat.v4.new_code_cell('y = x + 1'),
                                         nbformat.v4.new_code_cell("raise ValueError('bad row 7: unknown role')")])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    path = tmp_path / 'fails.ipynb'
    nbformat.write(nb, path)
    r = sft_nb('run', path, '-p', 'x', '2', '--run-dir', tmp_path)
    assert r.returncode == 1
    assert "`raise ValueError('bad row 7: unknown role')` failed: ValueError: bad row 7: unknown role" in r.stderr
    assert (tmp_path / 'fails.executed.ipynb').exists() and len(nbformat.read(path, as_version=4).cells) == 3


def test_train_yaml_and_run_notebook(tmp_path):
    r = sft_nb('train', ROOT / 'examples' / 'tiny.yaml', f'checkpoint.run_dir={tmp_path / "yaml"}')
    assert r.returncode == 0, r.stderr[-3000:]
    summary, losses = read_run(tmp_path / 'yaml')
    assert summary['steps'] == 6 and summary['train_losses'] == losses and (tmp_path / 'yaml' / 'hf' / 'config.json').exists()

    run = tmp_path / 'nb'
    r = sft_nb('run', TRAIN_NB, '-p', 'max_steps', '3', '--run-dir', run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'train' in r.stdout  # cell output was streamed
    summary, losses = read_run(run)
    executed = nbformat.read(run / 'train.ipynb', as_version=4)
    assert summary['steps'] == 3 and summary['train_losses'] == losses and len(losses) == 3
    assert any('"steps": 3' in o.get('text', '') for c in executed.cells for o in c.get('outputs', []))
    assert (run / 'checkpoints' / 'step_000003' / 'trainer_state.json').exists() and (run / 'hf' / 'config.json').exists()


def test_train_takes_sequence_parallel(tmp_path):
    """`sft-nb train CONFIG placement.sequence_parallel=N` (issue 28): sp=3 on 2 workers is refused by the config before any
    worker starts; sp=2 on 2 workers trains, its run's config.yaml says sp=2, and its first loss is one worker's."""
    import yaml
    tiny = ROOT / 'examples' / 'tiny.yaml'
    r = sft_nb('train', tiny, 'placement.workers_per_node=2', 'placement.sequence_parallel=3', f'checkpoint.run_dir={tmp_path / "bad"}')
    assert r.returncode != 0 and 'sequence_parallel: 3 must divide world size 2' in r.stderr, r.stderr[-2000:]
    losses = {}
    for name, ov in {'1': [], 'sp2': ['placement.workers_per_node=2', 'placement.sequence_parallel=2']}.items():
        r = sft_nb('train', tiny, 'train.num_steps=1', 'checkpoint.export_hf=false', f'checkpoint.run_dir={tmp_path / name}', *ov)
        assert r.returncode == 0, r.stderr[-3000:]
        losses[name] = read_run(tmp_path / name)[1]
    assert yaml.safe_load((tmp_path / 'sp2' / 'config.yaml').read_text())['placement']['sequence_parallel'] == 2
    assert len(losses['sp2']) == 1 and abs(losses['sp2'][0] - losses['1'][0]) <= 2e-6 * abs(losses['1'][0]), losses  # before any update


def test_synthetic_throughput_run_with_profiler(tmp_path):
    "A data-free LoRA batch run: synthetic full-context rows in data order, a torch.profiler window on step 2, the adapter exported."
    run = tmp_path / 'synth'
    r = sft_nb('run', TRAIN_NB, '-p', 'synthetic_rows', '16', '-p', 'max_length', '32', '-p', 'max_steps', '2', '-p', 'global_batch_size', '4',
               '-p', 'sampler', 'sequential', '-p', 'profile_step', '2', '-p', 'eval_fraction', '0.0',
               '-p', 'lora_r', '4', '-p', 'lora_export', 'adapter', '--run-dir', run)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines() if '"loss"' in l]
    assert [m['n_real'] for m in rows] == [4 * 32] * 2 and [m['n_trained'] for m in rows] == [4 * 31] * 2
    assert (run / 'profile' / 'steps_2-2' / 'rank0.json').stat().st_size > 0
    assert (run / 'hf' / 'adapter_config.json').exists() and not (run / 'hf' / 'model.safetensors').exists()


def _ray_node(args, tmp):
    "Start one Ray node with `--block` so that terminating this PID stops exactly the node we started."
    log = open(tmp / f'ray_{len(list(tmp.glob("ray_*")))}.log', 'w')
    return subprocess.Popen(['ray', 'start', '--block', '--num-cpus=1', '--object-store-memory=200000000',
                             '--disable-usage-stats', *args], env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try: p.wait(30)
        except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def test_two_node_cluster_matches_one_node(tmp_path):
    "2 workers spread over a real 2-node Ray cluster train exactly like 2 workers on one node."
    port = _free_port()
    head = _ray_node(['--head', f'--port={port}', '--node-ip-address=127.0.0.1', '--include-dashboard=false'], tmp_path)
    nodes = [head]
    try:
        import ray
        deadline = time.time() + 90
        while time.time() < deadline:  # wait for the head's GCS before the second node joins
            if subprocess.run(['ray', 'status', f'--address=127.0.0.1:{port}'], env=ENV, capture_output=True).returncode == 0: break
            time.sleep(1)
        nodes.append(_ray_node([f'--address=127.0.0.1:{port}', '--node-ip-address=127.0.0.1'], tmp_path))
        while time.time() < deadline:
            out = subprocess.run(['ray', 'status', f'--address=127.0.0.1:{port}'], env=ENV, capture_output=True, text=True).stdout
            if out.count('node_') >= 2: break
            time.sleep(1)
        common = ['-p', 'max_steps', '3', '-p', 'workers_per_node', '1', '-p', 'global_batch_size', '8', '-p', 'micro_batch_size', '2',
                  '-p', 'export_hf', 'false']
        r = sft_nb('run', TRAIN_NB, *common, '-p', 'num_nodes', '2', '-p', 'strategy', 'STRICT_SPREAD',
                   '-p', 'ray_address', f'127.0.0.1:{port}', '--run-dir', tmp_path / 'spread')
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        for p in reversed(nodes): _stop(p)
    spread, spread_losses = read_run(tmp_path / 'spread')
    assert len(set(spread['worker_nodes'])) == 2  # one worker on each node

    r = sft_nb('run', TRAIN_NB, '-p', 'max_steps', '3', '-p', 'workers_per_node', '2', '-p', 'global_batch_size', '8',
               '-p', 'micro_batch_size', '2', '-p', 'export_hf', 'false', '--run-dir', tmp_path / 'local')
    assert r.returncode == 0, r.stderr[-3000:]
    local, local_losses = read_run(tmp_path / 'local')
    assert len(set(local['worker_nodes'])) == 1
    assert spread_losses == pytest.approx(local_losses, rel=1e-6)  # the same 2 ranks, on one node or two
