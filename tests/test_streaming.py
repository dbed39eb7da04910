"""Streaming sources: `data.streaming` reads the train source lazily into a bounded window
(`sft_nb.stream.StreamPlan`); a killed streamed run resumes with exactly the batches and losses of an uninterrupted one."""
import json, os, signal, subprocess, sys, textwrap, time
from pathlib import Path
import pytest
from helpers import run_cfg
from sft_nb.config import ConfigError, load_config
from sft_nb.demo_data import identity_rows
from sft_nb.stream import StreamPlan
from sft_nb.trainer import SFTTrainer


@pytest.fixture(scope='module')
def jsonl(tmp_path_factory) -> Path:
    "The identity train rows (56) as a JSONL file of 57 lines, with one broken line (a bad row, counted, the rest streams)."
    p = tmp_path_factory.mktemp('stream') / 'identity.jsonl'
    lines = [json.dumps(r) for r in identity_rows()['train']]
    p.write_text('\n'.join(lines[:10] + ['{"messages": [broken'] + lines[10:]) + '\n')
    return p


def stream_cfg(tiny_path, run_dir, src, **kw) -> dict:
    kw = {'data__streaming': True, 'data__stream_buffer': 16, 'data__train': [{'path': str(src)}],
          'tokenize__max_length': 256, 'train__num_steps': 10, **kw}
    return run_cfg(tiny_path, run_dir, **kw)


# ---- kill -9 of a streamed run, then resume -----------------------------------------------------------------------
DRIVER = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    from sft_nb.trainer import SFTTrainer
    from sft_nb.callbacks import Callback
    cfg, at, marker = json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    class Hang(Callback):  # after the checkpoint of step `at`: say so, and wait to be killed
        def on_save(self, trainer, path):
            if trainer.global_step == at: marker.write_text(path); time.sleep(600)
    SFTTrainer(cfg, [Hang()]).fit()
    sys.exit(3)  # not reached: the parent kills this process first
''')


@pytest.mark.parametrize('packed', [False, True], ids=['padded', 'packed'])
def test_killed_streamed_run_resumes_exactly(tiny_path, tmp_path, ray_session, jsonl, packed):
    import ray
    gcs = ray.get_runtime_context().gcs_address
    # 10 steps × 8 = 80 examples (packed: 160) from a 57-row source: later passes run after the kill at step 6
    base = dict(checkpoint__save_every=3, checkpoint__keep_last=2, placement__ray_address=gcs, packing__enabled=packed,
                data__stream_buffer=24, tokenize__max_length=96)  # packed: two rows per bin, 8 bins of a 12-bin window
    with SFTTrainer(stream_cfg(tiny_path, tmp_path / 'straight', jsonl, **base)) as t:
        straight = t.fit()['loss'].tolist()
        assert t.data.epoch >= 1 and t.data.peak <= 24
        assert t.data_report.dropped == {'bad_json': 1} and (t.data_report.n_rows, t.data_report.n_kept) == (57, 56)  # the broken line: one bad row
    run, marker = tmp_path / 'killed', tmp_path / 'saved'
    env = {**os.environ, 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'HF_HUB_OFFLINE': '1'}
    p = subprocess.Popen([sys.executable, '-c', DRIVER, json.dumps(stream_cfg(tiny_path, run, jsonl, **base)), '6', str(marker)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not marker.exists() and p.poll() is None: time.sleep(0.2)
        assert marker.exists(), p.communicate()[0][-3000:]
        os.killpg(p.pid, signal.SIGKILL)  # a real kill, right after the checkpoint of step 6
        p.wait(60)
    finally:
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL); p.wait(60)
    assert p.returncode == -signal.SIGKILL
    state = json.loads((run / 'checkpoints' / 'step_000006' / 'trainer_state.json').read_text())
    assert state['stream']['step'] == 6 and len(state['stream']['buffer']) <= 24  # the state before step 7's batch, not after the prefetch
    assert state['stream']['cursor'][0][0] > 0  # the JSONL byte offset a resume seeks to
    with SFTTrainer(stream_cfg(tiny_path, run, jsonl, checkpoint__resume='latest', **base)) as r:
        assert r.global_step == 6
        resumed = r.fit()['loss'].tolist()
    assert len(resumed) == len(straight) == 10
    assert resumed == pytest.approx(straight, rel=1e-6), (resumed, straight)


def test_stream_resume_refuses_a_map_style_checkpoint(tiny_path, tmp_path, ray_session, jsonl):
    base = dict(train__num_steps=2, checkpoint__save_every=1)
    with SFTTrainer(run_cfg(tiny_path, tmp_path / 'run', data__train=[{'path': str(jsonl)}], **base)) as t: t.fit()
    with pytest.raises(ConfigError, match="data.streaming: False in the checkpoint's run, True in this config"):
        SFTTrainer(stream_cfg(tiny_path, tmp_path / 'run', jsonl, checkpoint__resume='latest', **base)).setup()


# ---- the window ---------------------------------------------------------------------------------------------------
def plan(tiny_tok, src, **kw):
    cfg = load_config(stream_cfg('tiny', '/tmp/unused', src, **kw))
    return StreamPlan(cfg, tiny_tok).prepare().plan()


def test_buffer_is_bounded(tiny_tok, tmp_path, jsonl):
    big = tmp_path / 'big.jsonl'
    big.write_text(jsonl.read_text() * 40)  # 2,240 rows
    sp = plan(tiny_tok, big, data__stream_buffer=5, train__global_batch_size=4, train__micro_batch_size=1)
    assert len(sp.buffer) == 5 and sp.pos == [5]  # only what the window holds was read, not the source
    for s in range(60):
        assert len(sp.global_batch(s)) == 4
        assert len(sp.buffer) + len(sp.carry) <= 5
    assert sp.peak <= 5 and sp.pos[0] < 300  # 240 examples trained: the source was read about that far, no further



def test_default_draw_never_trains_an_example_twice_in_a_step(tiny_tok, jsonl):
    """The default unpacked draw (sampler 'random'): each step takes global_batch_size distinct examples out of the window,
    over 30 steps that pass through the 56-row source four times (a window of 12, a batch of 8: the draw picks 8 of 12)."""
    sp = plan(tiny_tok, jsonl, data__stream_buffer=12)
    assert sp.cfg.train.sampler == 'random' and not sp.cfg.packing.enabled and sp.cfg.train.global_batch_size == 8
    steps = [[(e['source'], e['index']) for e in sp.global_batch(s)] for s in range(30)]
    assert all(len(b) == len(set(b)) == 8 for b in steps), next(b for b in steps if len(set(b)) < len(b))
    assert sp.passes[0] >= 4

def test_streaming_config_errors(tiny_path, tmp_path, jsonl):
    with pytest.raises(ConfigError, match=r'train\.num_steps: required with data\.streaming=true: a stream has no known length'):
        SFTTrainer(stream_cfg(tiny_path, tmp_path, jsonl, train__num_steps=None))
    with pytest.raises(ConfigError, match=r'train\.num_steps: required.*num_epochs'):
        SFTTrainer(stream_cfg(tiny_path, tmp_path, jsonl, train__num_steps=None, train__num_epochs=2))
    with pytest.raises(ConfigError, match=r'data\.stream_buffer: must be >= 1'):
        load_config(stream_cfg(tiny_path, tmp_path, jsonl, data__stream_buffer=0))
    with pytest.raises(ConfigError, match=r'data\.eval_fraction'):
        load_config(stream_cfg(tiny_path, tmp_path, jsonl, data__eval_fraction=0.1))
    with pytest.raises(ConfigError, match=r'train\.sampler'):
        SFTTrainer(stream_cfg(tiny_path, tmp_path, jsonl, train__sampler='my.mod:Sampler'))


def test_packed_steps_train_the_window_rows(tiny_tok, jsonl):
    sp = plan(tiny_tok, jsonl, packing__enabled=True, tokenize__max_length=96, data__stream_buffer=24)
    seen = []  # every example that entered the window, in order
    examples = sp.examples
    sp.examples = lambda rows: seen.extend(out := examples(rows)) or out
    seen += sp.buffer  # what prepare() filled
    trained = []
    for s in range(12):
        sp.fill(); window = list(sp.buffer)  # the window this step is packed from (draw's own fill then reads nothing)
        bins = sp.global_batch(s)
        assert 0 < len(bins) <= 8 and all(sum(len(e['input_ids']) for e in b) <= 96 for b in bins)
        taken = [e for b in bins for e in b]
        assert all(any(e is w for w in window) for e in taken)  # packed from the window only
        batches, _, n_trained, n_real = sp.rank_batches(bins)
        labels = [mb['labels'] for mbs in batches for mb in mbs]
        got = [int(x) for lab in labels for row in lab for x in row if x != -100]
        want = [t for e in taken for t, m in zip(e['input_ids'], e['loss_mask']) if m]
        assert got == want and n_trained == len(want) and n_real == sum(len(e['input_ids']) for e in taken)
        trained += taken
    ids = lambda es: sorted(id(e) for e in es)
    assert ids(trained + sp.buffer + sp.carry) == ids(seen)  # each example of the window trained once, or still waiting


def test_iterable_dataset_source_and_state_roundtrip(tiny_tok, tmp_path):
    "A `datasets.IterableDataset` (what a hub source streams as) is read lazily; a plan restored from JSON continues it."
    from datasets import Dataset
    rows = identity_rows()['train']
    ds = Dataset.from_list([{'messages': r['messages']} for r in rows]).to_iterable_dataset()
    cfg = load_config(stream_cfg('tiny', tmp_path, tmp_path / 'unused.jsonl', data__train=[], data__stream_buffer=10,
                                 train__global_batch_size=4, train__micro_batch_size=1, train__num_steps=30))
    straight = StreamPlan(cfg, tiny_tok, train_data=ds).prepare().plan()
    want = [[e['index'] for e in straight.global_batch(s)] for s in range(30)]
    assert straight.epoch >= 1 and straight.peak <= 10  # 120 examples of 56 rows: the stream restarted
    a = StreamPlan(cfg, tiny_tok, train_data=ds).prepare().plan()
    got = [[e['index'] for e in a.global_batch(s)] for s in range(13)]
    b = StreamPlan(cfg, tiny_tok, train_data=ds).prepare().plan()
    b.load_state_dict(json.loads(json.dumps(a.state_dict(12))))  # the state a checkpoint after 12 steps stores
    got = got[:12] + [[e['index'] for e in b.global_batch(s)] for s in range(12, 30)]
    assert got == want
    assert b.data_report.n_rows == 56 and b.data_report.n_kept == 56


def test_streamed_train_evaluates_and_saves(tiny_path, tmp_path, ray_session, jsonl):
    "`train()` of a streamed run: eval sets are tokenized as in the map path, evaluated with generation samples, saved."
    ev = tmp_path / 'eval.jsonl'
    ev.write_text(''.join(json.dumps(r) + '\n' for r in identity_rows()['eval']))
    cfg = stream_cfg(tiny_path, tmp_path / 'run', jsonl, train__num_steps=3, data__eval={'id': {'path': str(ev)}}, eval__samples=2)
    with SFTTrainer(cfg) as t:
        h = t.train()
        assert len(h) == 3 and t.last_eval['step'] == 3 and 'id_loss' in t.last_eval
        assert (t.run_dir / 'checkpoints' / 'step_000003' / 'trainer_state.json').exists()


def test_expanded_rows_wait_in_carry_and_resume(tiny_path, tmp_path):
    "rewritten_turns='expand' (Qwen3 rewrites earlier turns): a row gives one example per assistant turn; those without room in the window wait in `carry`, which the state keeps."
    from transformers import AutoTokenizer
    from test_reasoning import FIX, MULTI, REASONING, SINGLE
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.add_special_tokens({'additional_special_tokens': ['<|im_start|>', '<|im_end|>']})
    src = tmp_path / 'expand.jsonl'
    src.write_text(''.join(json.dumps({'messages': m}) + '\n' for m in [MULTI, REASONING, SINGLE] * 10))
    cfg = load_config(stream_cfg('tiny', tmp_path, src, data__stream_buffer=3, tokenize__chat_template=str(FIX / 'qwen3.jinja'),
                                 tokenize__max_length=512, train__global_batch_size=2, train__micro_batch_size=1, train__num_steps=40))
    sp = StreamPlan(cfg, tok).prepare().plan()
    want, states = [], {}
    for s in range(40):
        states[s] = json.loads(json.dumps(sp.state_dict(s)))
        want.append([(e['index'], len(e['input_ids'])) for e in sp.global_batch(s)])
        assert len(sp.buffer) <= 3 and sp.peak <= 2 * 3  # window ≤ stream_buffer; with the carry ≤ rows read × turns per row
    assert sp.data_report.n_examples == 50 and sp.data_report.n_kept == 30  # 10 × (2 + 2 + 1) examples of 30 rows
    s = next(s for s in range(1, 40) if states[s]['carry'])  # a state with examples waiting outside the window
    r = StreamPlan(cfg, tok).prepare().plan(); r.load_state_dict(states[s])
    assert [[(e['index'], len(e['input_ids'])) for e in r.global_batch(k)] for k in range(s, 40)] == want[s:]


def test_weighted_sources_interleave_and_resume(tiny_tok, tmp_path, jsonl, shared):
    "Two sources in different formats, weights 3 : 1: rows interleave by weight, the small one repeats, each is reported, a resume is exact."
    alpaca = tmp_path / 'alpaca.jsonl'
    alpaca.write_text(''.join(json.dumps(r) + '\n' for r in json.loads((shared / 'datasets' / 'alpaca_en_demo.json').read_text())[:20]))
    cfg = load_config(stream_cfg('tiny', tmp_path, jsonl, data__train=[{'path': str(jsonl), 'weight': 3.0}, {'path': str(alpaca)}],
                                 tokenize__max_length=1024, train__num_steps=30))
    sp = StreamPlan(cfg, tiny_tok).prepare().plan()
    assert sp.fmts == ['messages', 'alpaca']
    want, states = [], {}
    for s in range(30):
        states[s] = json.loads(json.dumps(sp.state_dict(s)))
        want.append([(e['source'], e['index']) for e in sp.global_batch(s)])
    drawn = [src for b in want for src, _ in b]
    assert 0.6 < drawn.count(0) / len(drawn) < 0.9  # ≈ 3/4 from the weight-3 source
    assert sp.passes[1] >= 1  # 20 alpaca rows, ~60 drawn: the small source repeated
    by = {d['source']: d for d in sp.data_report.sources}
    assert by[str(alpaca)]['n_rows'] == 20 and by[str(jsonl)]['n_rows'] == 57 and by[str(jsonl)]['n_kept'] == 56
    assert [(d['weight'], d['share']) for d in sp.data_report.sources] == [(3.0, 0.75), (1.0, 0.25)]
    assert sp.data_report.dropped['bad_json'] == 1 and f"{alpaca}: weight 1 (25% of draws), 20 rows, " in str(sp.data_report)
    r = StreamPlan(cfg, tiny_tok).prepare().plan(); r.load_state_dict(states[11])
    assert [[(e['source'], e['index']) for e in r.global_batch(k)] for k in range(11, 30)] == want[11:]
    one = StreamPlan(load_config(stream_cfg('tiny', tmp_path, jsonl, train__num_steps=30)), tiny_tok).prepare().plan()
    with pytest.raises(ConfigError, match='data.train: the checkpoint.s run streamed 2 train sources, this config 1'):
        one.load_state_dict(states[11])
