"""Batch runs: `sft-nb run` (papermill) and `sft-nb train`, parameter checks, failures, and a real two-node Ray cluster.
One real process per command (the wiring); the rest runs `sft_nb.cli.main` in this process on the session's Ray cluster."""
import json, math, os, signal, socket, subprocess, sys, time
from pathlib import Path
import nbformat
import pytest
from helpers import cli
from jupyter_lab import screenshot_tool

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


def read_samples(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / 'samples.jsonl').read_text().splitlines()]


def test_bad_parameter_type_fails_before_running(tmp_path):
    "A parameter value of the wrong type is refused before a kernel starts (an unknown name: nbs/11_cli.ipynb)."
    code, _, err = cli('run', TRAIN_NB, '-p', 'max_steps', 'lots', '--run-dir', tmp_path / 'run')
    assert code != 0 and "parameter 'max_steps': expected int, got 'lots'" in err
    assert not (tmp_path / 'run' / 'train.ipynb').exists()  # no kernel was started


def test_notebook_parameters_reach_the_config(tmp_path):
    "The tokenize options, checkpoint.overwrite and sequence_parallel are notebook parameters, listed by papermill and put in the config."
    import papermill
    names = ('rewritten_turns', 'train_on_reasoning', 'train_on_tool_calls', 'overwrite', 'sequence_parallel')
    assert set(names) <= set(papermill.inspect_notebook(str(TRAIN_NB)))
    cells = nbformat.read(TRAIN_NB, as_version=4).cells
    ns = {}
    exec(next(c.source for c in cells if 'parameters' in c.metadata.get('tags', [])), ns)
    ns.update(rewritten_turns='final', train_on_reasoning=False, train_on_tool_calls=False, overwrite=True, run_dir=str(tmp_path / 'run'))
    exec(next(c.source for c in cells if 'cfg = load_config(' in c.source), ns)  # builds the config and an SFTTrainer (no Ray yet)
    t, ck = ns['cfg'].tokenize, ns['cfg'].checkpoint
    assert (t.rewritten_turns, t.train_on_reasoning, t.train_on_tool_calls, ck.overwrite) == ('final', False, False, True)
    ns.update(workers_per_node=2, sequence_parallel=2)
    exec(next(c.source for c in cells if 'cfg = load_config(' in c.source), ns)
    assert (ns['cfg'].placement.sequence_parallel, ns['cfg'].placement.dp_size) == (2, 1)
    # a data-free LoRA throughput run (what it trains: nbs/08_trainer.ipynb's synthetic run with a profiler window)
    ns.update(synthetic_rows=16, max_length=32, sampler='sequential', profile_step=2, eval_fraction=0.0, lora_r=4, lora_export='adapter')
    exec(next(c.source for c in cells if 'cfg = load_config(' in c.source), ns)
    c = ns['cfg']
    assert (c.data.synthetic_rows, c.tokenize.max_length, c.train.sampler, c.logging.profile_step, c.data.eval_fraction) == (16, 32, 'sequential', 2, 0.0)
    assert (c.model.lora_r, c.checkpoint.lora_export) == (4, 'adapter')


def test_failing_notebook_names_the_cell(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('x = 1', metadata={'tags': ['parameters']}),
                                         nbformat.v4.new_code_cell('y = x + 1'),
                                         nbformat.v4.new_code_cell("raise ValueError('bad row 7: unknown role')")])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    path = tmp_path / 'fails.ipynb'
    nbformat.write(nb, path)
    code, _, err = cli('run', path, '-p', 'x', '2', '--run-dir', tmp_path)
    assert code == 1
    assert "`raise ValueError('bad row 7: unknown role')` failed: ValueError: bad row 7: unknown role" in err
    assert (tmp_path / 'fails.executed.ipynb').exists() and len(nbformat.read(path, as_version=4).cells) == 3


def test_train_yaml_and_run_notebook(tmp_path, ray_session, browser):
    """The two batch commands on the session's cluster: `sft-nb train tiny.yaml` (in this process; as a process of its own:
    tests/test_reliability_signals.py) trains, exports and answers its eval samples; `sft-nb run examples/train.ipynb`, a
    real process, compared with it streams its cells, writes the executed notebook, a checkpoint, the export, samples before
    and after training and compare.html with both runs' curves; the same command with `-p resume latest -p max_steps 5` then
    extends that finished run."""
    code, _, err = cli('train', ROOT / 'examples' / 'tiny.yaml', f'checkpoint.run_dir={tmp_path / "cli"}', 'train.num_steps=2',
                       'eval.max_new_tokens=8')
    assert code == 0, err[-3000:]
    summary, losses = read_run(tmp_path / 'cli')
    assert summary['steps'] == 2 and summary['train_losses'] == losses and (tmp_path / 'cli' / 'hf' / 'config.json').exists()
    assert [x['step'] for x in read_samples(tmp_path / 'cli')] == [2] * 4  # the CLI's final eval answered them too

    run = tmp_path / 'nb'
    r = sft_nb('run', TRAIN_NB, '-p', 'max_steps', '3', '-p', 'sample_tokens', '8', '-p', 'compare_with', f'[{tmp_path / "cli"}]',
               '-p', 'ray_address', ray_session, '--run-dir', run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'train' in r.stdout  # cell output was streamed
    summary, losses = read_run(run)
    assert summary['steps'] == 3 and summary['train_losses'] == losses and len(losses) == 3
    assert (run / 'checkpoints' / 'step_000003' / 'trainer_state.json').exists() and (run / 'hf' / 'config.json').exists()
    recs = read_samples(run)
    assert [x['step'] for x in recs] == [0] * 4 + [3] * 4 and {x['eval'] for x in recs} == {'heldout'}  # before and after training
    out = '\n'.join(o.get('text', '') for c in nbformat.read(run / 'train.ipynb', as_version=4).cells for o in c.get('outputs', []))
    assert '"steps": 3' in out
    # the kernel's stderr as the executed notebook keeps it: no Ray INFO line (`Connecting to existing Ray cluster`)
    assert 'INFO worker.py' not in out and 'Connecting to existing Ray cluster' not in out, out[-3000:]
    assert 'samples at step 0 (heldout):' in out and 'samples at step 3 (heldout):' in out and f"  Q: {recs[0]['prompt']}" in out
    html = (run / 'compare.html').read_text()
    assert 'sft-nb-compare' in html and 'nb train' in html and 'cli train' in html and 'optim.lr' in html  # lr 3e-4 vs tiny.yaml's 3e-3
    # the comparison offline in the browser: both runs' curves are drawn (plotly.js is inlined)
    page = browser.new_page(viewport={'width': 1100, 'height': 900})
    try:
        page.goto((run / 'compare.html').as_uri())
        page.wait_for_selector('#sft-nb-compare .scatterlayer .trace', timeout=30_000)
        legend = page.locator('#sft-nb-compare .legendtext').all_text_contents()
        assert {'nb train', 'cli train'} <= set(legend), legend  # one curve per run folder
        assert page.locator('#sft-nb-compare .scatterlayer .trace path.js-line').count() >= 2  # a drawn train curve per run
        (ROOT / 'build' / 'browser').mkdir(parents=True, exist_ok=True)
        png = ROOT / 'build' / 'browser' / 'compare_papermill.png'
        page.screenshot(path=str(png), full_page=True)
        screenshot_tool().check_png(png)  # not blank
    finally: page.close()

    # extending the finished run (README): `-p resume latest -p max_steps 5` trains steps 4-5 in the same folder, steps 1-3
    # kept as they were, the change and the LR rule in events.jsonl. It runs with `-p in_process true`: the worker in the
    # papermill kernel, no Ray (its node is this machine's name), from the checkpoint the Ray worker wrote
    code, _, err = cli('run', TRAIN_NB, '-p', 'resume', 'latest', '-p', 'max_steps', '5', '-p', 'eval_samples', '0',
                       '-p', 'in_process', 'true', '--run-dir', run)
    assert code == 0, err[-3000:]
    summary, longer = read_run(run)
    assert summary['steps'] == 5 and len(longer) == 5 and longer[:3] == losses, (longer, losses)
    assert summary['worker_nodes'] == [socket.gethostname()], summary['worker_nodes']
    ev = json.loads((run / 'events.jsonl').read_text().splitlines()[-1])
    assert ev['step'] == 3 and ev['changed']['train.num_steps'] == [3, 5] and 'lr_schedule' in ev, ev
    assert (run / 'checkpoints' / 'step_000005' / 'trainer_state.json').exists()


def test_train_refuses_a_sequence_parallel_that_does_not_divide_the_workers(tmp_path):
    """`sft-nb train CONFIG placement.sequence_parallel=3` on 2 workers is refused by the config, naming both numbers,
    before any worker starts. (sp=2 trains as one rank does, through the trainer and its workers:
    tests/test_sequence_parallel.py; an override reaches the run's config as every other does.)"""
    tiny = ROOT / 'examples' / 'tiny.yaml'
    code, _, err = cli('train', tiny, 'placement.workers_per_node=2', 'placement.sequence_parallel=3', f'checkpoint.run_dir={tmp_path / "bad"}')
    assert code != 0 and 'sequence_parallel: 3 must divide world size 2' in err, err[-2000:]
    assert not (tmp_path / 'bad').exists()


def _ray_node(args, tmp):
    """Start one Ray node with `--block` so that terminating this PID stops exactly the node we started. Its agents get
    their ports from us: with port 0 the raylet waits a fixed time for each agent to write its port to a file, and on a
    loaded machine the dashboard agent's start outlasts it ('Timed out waiting for file .../metrics_agent_port_...')."""
    from sft_nb.workers import free_port
    log = open(tmp / f'ray_{len(list(tmp.glob("ray_*")))}.log', 'w')
    ports = [f'--{k}={free_port()}' for k in ('dashboard-agent-grpc-port', 'dashboard-agent-listen-port', 'runtime-env-agent-port',
                                               'metrics-export-port')]
    return subprocess.Popen(['ray', 'start', '--block', '--num-cpus=1', '--object-store-memory=200000000',
                             '--disable-usage-stats', *ports, *args], env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try: p.wait(30)
        except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL)


def test_two_node_cluster_matches_one_node(tmp_path, ray_session):
    """2 workers spread over a real 2-node Ray cluster (the session's node and a second node that `ray start` joins to it)
    train exactly like 2 workers packed on one node of it. Both drivers are `sft-nb train` in this process (the notebook's
    driver on the cluster: test_train_yaml_and_run_notebook). The node registers before either trains: a run beside a
    raylet's start can make it miss its registration."""
    import ray
    alive = lambda: sum(n['Alive'] for n in ray.nodes())
    n0 = alive()
    common = [ROOT / 'examples' / 'tiny.yaml', 'train.num_steps=3', 'train.micro_batch_size=2', 'checkpoint.export_hf=false',
              'eval.samples=0']
    node = _ray_node([f'--address={ray_session}'], tmp_path)
    try:
        for attempt in range(2):  # `ray start` gives a raylet 30 s to register (fixed in Ray): a loaded machine can miss it once
            deadline = time.time() + 120
            while alive() <= n0 and node.poll() is None and time.time() < deadline: time.sleep(0.5)
            if alive() > n0 or attempt: break
            _stop(node)
            node = _ray_node([f'--address={ray_session}'], tmp_path)
        assert alive() > n0, (tmp_path / f'ray_{attempt}.log').read_text()[-3000:]
        code, _, err = cli('train', *common, 'placement.workers_per_node=2', 'placement.strategy=STRICT_PACK',
                           f'checkpoint.run_dir={tmp_path / "local"}')
        assert code == 0, err[-3000:]
        # not kept warm: its worker on the second node ends with that node
        code, _, err = cli('train', *common, 'placement.num_nodes=2', 'placement.workers_per_node=1', 'placement.strategy=STRICT_SPREAD',
                           'placement.keep_warm=false', f'checkpoint.run_dir={tmp_path / "spread"}')
        assert code == 0, err[-3000:]
    finally: _stop(node)
    spread, spread_losses = read_run(tmp_path / 'spread')
    local, local_losses = read_run(tmp_path / 'local')
    assert len(spread_losses) == 3
    assert len(set(spread['worker_nodes'])) == 2 and len(set(local['worker_nodes'])) == 1  # one worker on each node; both on one
    assert spread_losses == pytest.approx(local_losses, rel=1e-6)  # the same 2 ranks, on one node or two


def test_a_users_mistake_is_one_short_message_in_the_terminal_and_the_executed_notebook(tmp_path):
    """`sft-nb run` with a data file that does not exist: the terminal holds at most 6 lines (no traceback, no kernel log)
    naming the file, the cell and the fix; the executed notebook's error is the same box (2 lines) and its folded traceback one line of text."""
    r = sft_nb('run', TRAIN_NB, '-p', 'train_data', 'missing/chats.jsonl', '--run-dir', tmp_path / 'run', cwd=tmp_path)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode != 0 and len(out) <= 6 and 'Traceback' not in r.stdout + r.stderr, out
    assert 'without encryption' not in r.stdout + r.stderr, out  # the kernel's start-up log is not the user's
    assert any("MissingFile: data source 'missing/chats.jsonl' does not exist" in l and 'trainer.setup()' in l for l in out), out
    assert f'fix: check the path (a relative one is read from {tmp_path})' in out, out
    nb = json.loads((tmp_path / 'run' / 'train.ipynb').read_text())
    outputs = [o for c in nb['cells'] for o in c.get('outputs', [])]
    (err,) = [o for o in outputs if o['output_type'] == 'error']
    assert len(err['traceback']) == 2 and 'fix: check the path' in err['traceback'][1], err['traceback']
    texts = [''.join(o['data']['text/plain']) for o in outputs if o['output_type'] == 'display_data' and 'text/plain' in o['data']]
    assert any(t.startswith('(traceback folded:') and '\n' not in t for t in texts), texts


def test_a_genuine_bug_in_a_notebook_keeps_its_traceback(tmp_path):
    "A cell that raises an exception which is no user mistake (a KeyError): `sft-nb run` prints the kernel's traceback and the failing cell."
    nb = nbformat.v4.new_notebook(metadata={'kernelspec': {'name': 'python3', 'display_name': 'python3', 'language': 'python'}})
    nb.cells = [nbformat.v4.new_code_cell("key = 'b'", metadata={'tags': ['parameters']}),
                nbformat.v4.new_code_cell("def lookup(k): return {'a': 1}[k]\nlookup(key)")]
    nbformat.write(nb, tmp_path / 'bug.ipynb')
    r = sft_nb('run', tmp_path / 'bug.ipynb', '--run-dir', tmp_path / 'run', cwd=tmp_path)
    assert r.returncode != 0 and 'Traceback (most recent call last)' in r.stderr and 'lookup(key)' in r.stderr, r.stderr
    assert "failed: KeyError: 'b'" in r.stderr, r.stderr
