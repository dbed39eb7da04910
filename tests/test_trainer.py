"""SFTTrainer: micro-batch split invariance (one rank, in process) and 2 ranks == 1 under Ray, exact resume, schedules, export, callbacks, LoRA."""
import json, math
from pathlib import Path
import pytest
import torch
from sft_nb.numerics import assert_rel_close, rel_gap
from sft_nb.demo_data import identity_rows
from sft_nb.optim import lr_at
from sft_nb.trainer import SFTTrainer
from sft_nb.callbacks import Callback
from helpers import local_run, run_cfg

ROWS = identity_rows()['train']
# fractional loss weights (issue 14 item 4); every 4th row keeps weight 1, so 0/1 rows share micro-batches with weighted ones
WROWS = [{'messages': [{**m, 'loss_weight': [0.25, 1, 2.5, 0.5][k % 4]} if m['role'] == 'assistant' else m for m in r['messages']]}
         for k, r in enumerate(ROWS)]


def uneven(rows):
    "Every other row without its system prompt and with a 3-word answer: short rows that padding-free lays out 2 or 3 to a row."
    short = lambda r: {'messages': [m if m['role'] != 'assistant' else {**m, 'content': ' '.join(m['content'].split()[:3])}
                                    for m in r['messages'] if m['role'] != 'system']}
    return [short(r) if k % 2 else r for k, r in enumerate(rows)]


def make_cfg(tiny_path, run_dir, **kw):
    "No clipping: the parity tests compare raw gradients."
    return run_cfg(tiny_path, run_dir, **{'optim__max_grad_norm': 0.0, **kw})


def weights(t):
    return t.group.call('full_state')[0]




# Adam's first update is lr·g/(|g|+eps): with eps=1e-8 it turns 1e-9 float noise in near-zero gradients into ±lr weight
# noise. eps=1e-5 keeps the update linear in such gradients, so the weights compare the gradients themselves (a
# per-micro-batch normalization bug still shows, in grad_norm and weights).
SPLIT = {'optim__lr': 1e-3, 'optim__eps': 1e-5}
PACKED = {'packing__enabled': True, 'packing__capacity': 128, 'tokenize__max_length': 64, 'train__global_batch_size': 4}  # 2 bins a step


def assert_same_step(a, b, what):
    "Loss and grad norm of their magnitude, weights of one step's update (lr = 1e-3 with Adam); Σ weight exactly (binary fractions)."
    (ma, wa), (mb, wb) = a, b
    assert ma['weight_sum'] == mb['weight_sum'], what
    print(f"{what}: relative gaps loss {rel_gap(ma['loss'], mb['loss']):.1e}, grad_norm {rel_gap(ma['grad_norm'], mb['grad_norm']):.1e}, "
          f"weights {rel_gap(wa, wb, scale=1e-3):.1e} of one update")
    assert_rel_close(ma['loss'], mb['loss'], 2e-6, f'{what} loss'); assert_rel_close(ma['grad_norm'], mb['grad_norm'], 1e-5, f'{what} grad_norm')
    assert_rel_close(wa, wb, 1e-2, f'{what} weights', scale=1e-3)


@pytest.mark.parametrize('weighted', [False, True], ids=['0/1 weights', 'fractional weights'])
@pytest.mark.parametrize('layout', ['padded', 'padding-free', 'packed'])
def test_micro_batch_split_invariance(tiny_path, tmp_path, layout, weighted):
    """One rank (in this process): a global batch as micro-batches of 1 or as one micro-batch gives the same loss, grad
    norm, Σ weight and weights. With fractional loss weights the loss is Σ weight·NLL ÷ Σ weight over the global batch,
    so the same holds, and it differs from the unweighted loss (the divisor is Σ weight, not the count). Padding-free
    (the default without packing): the micro-batch of 8 rows runs on fewer positions than its padded rows, and a row
    alone stays padded, so that case compares the padding-free layout with the padded one."""
    packed = layout == 'packed'
    extra, big = {**SPLIT, **(PACKED if packed else {}), 'packing__padding_free': layout != 'padded'}, 4 if packed else 8
    rows = (uneven if layout == 'padding-free' else list)(WROWS if weighted else ROWS)
    runs = [local_run(make_cfg(tiny_path, tmp_path / str(mb), **extra, train__micro_batch_size=mb), rows) for mb in (1, big)]
    (m1,), w1 = runs[0]
    (m2,), w2 = runs[1]
    if weighted: assert m1['weight_sum'] != m1['n_trained']
    if layout == 'padding-free':  # the 8 rows' positions, padded, against what the padding-free micro-batch ran
        (padded,), _ = local_run(make_cfg(tiny_path, tmp_path / 'rows', **{**extra, 'packing__padding_free': False},
                                          train__micro_batch_size=big), rows)
        assert m2['positions'] < padded['positions'], (m2['positions'], padded['positions'])
    assert_same_step((m1, w1), (m2, w2), f'{layout} weighted={weighted}: 1 micro-batch vs {big}')
    if weighted and layout == 'padded':
        (plain,), _ = local_run(make_cfg(tiny_path, tmp_path / 'plain', **extra, train__micro_batch_size=1), ROWS)
        assert plain['weight_sum'] != m1['weight_sum'] and rel_gap(plain['loss'], m1['loss']) > 1e-3


def test_two_ranks_equal_one(tiny_path, tmp_path, ray_session):
    """2 ranks × 2 micro-batches of 1 packed bin under Ray, fractional loss weights: the same step as 1 rank with micro-batches
    of 1 (each rank's loss divides by the global Σ weight). Evaluation is Σ weight·NLL ÷ Σ weight, so rows all weighted 2.5
    evaluate exactly as the same rows unweighted."""
    extra = {**SPLIT, **PACKED, 'train__micro_batch_size': 1}
    ref = local_run(make_cfg(tiny_path, tmp_path / 'one', **extra), WROWS)
    evals = {'plain': ROWS[:8], 'x2.5': [{'messages': [{**m, 'loss_weight': 2.5} for m in r['messages']]} for r in ROWS[:8]]}
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'two', **extra, placement__workers_per_node=2), train_data=WROWS, eval_data=evals) as t:
        m = t.step()
        assert 'loss_weights' in t.data.train_sets[0].column_names
        e = t.evaluate()
        assert abs(e['x2.5_loss'] - e['plain_loss']) <= 1e-6 * e['plain_loss'], e
        assert_same_step((m, weights(t)), (ref[0][0], ref[1]), '2 ranks vs 1')


def test_exact_resume_and_fewer_workers(tiny_path, tmp_path, ray_session):
    "6 steps straight == 3 steps, save, kill the actors, resume in new ones, 3 more; also resumed on 1 worker instead of 2."
    base = dict(train__num_steps=6, train__micro_batch_size=2, placement__workers_per_node=2, optim__schedule='cosine')
    t = SFTTrainer(make_cfg(tiny_path, tmp_path / 'half', **base), train_data=ROWS)
    t.fit(3)
    ckpt = t.save()  # the straight run goes on from here; a save changes nothing of it
    full = t.fit()['loss'].tolist()
    w_full = weights(t)
    t.group.kill()  # the actors die; nothing is saved on the way out
    t.group = None
    t.shutdown()
    for workers, name in ((2, 'resume2'), (1, 'resume1')):
        with SFTTrainer(make_cfg(tiny_path, tmp_path / name, checkpoint__resume=str(ckpt),
                                 **{**base, 'placement__workers_per_node': workers}), train_data=ROWS) as r:
            assert r.global_step == 3
            resumed = r.fit()['loss'].tolist()
            w = weights(r)
        assert resumed[:3] == full[:3]
        assert_rel_close(resumed[3:], full[3:], 4e-6, f'{name} losses'); assert_rel_close(w, w_full, 2e-4, f'{name} weights', scale=1e-2 * 6)  # of 6 updates of lr
    lines = [json.loads(l) for l in (tmp_path / 'resume2' / 'metrics.jsonl').read_text().splitlines()]
    assert [l['step'] for l in lines if l['kind'] == 'train'] == [4, 5, 6]  # a resumed run's log goes on from its checkpoint


def test_in_process_equals_ray(tiny_path, tmp_path, ray_session):
    """`placement.in_process` (one worker in this process, no Ray): 3 steps equal the same run under Ray. Between them a
    call that raises kills its group (`WorkerError`), and `restart_workers` goes on from the step-2 checkpoint."""
    from sft_nb.workers import WorkerError
    base = dict(train__num_steps=3, train__micro_batch_size=2, optim__schedule='cosine')
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'ray', **base), train_data=ROWS) as t:
        ray_losses, w_ray = t.fit()['loss'].tolist(), weights(t)
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'here', **base, placement__in_process=True), train_data=ROWS) as t:
        assert type(t.group).__name__ == 'LocalGroup' and not t._ray_started
        t.fit(2); t.save()
        with pytest.raises(WorkerError, match=r'worker rank 0 failed in run: ZeroDivisionError'): t.backend.run(lambda w: 1 / 0)
        with pytest.raises(WorkerError, match='the worker group is dead'): t.step()
        assert t.restart_workers() == 2
        losses, w = t.fit()['loss'].tolist(), weights(t)
    print(f"in process vs Ray: relative gaps loss {rel_gap(losses, ray_losses):.1e}, weights {rel_gap(w, w_ray):.1e}")
    assert_rel_close(losses, ray_losses, 4e-6, 'losses'); assert_rel_close(w, w_ray, 2e-4, 'weights', scale=1e-2 * 3)


def test_epochs_with_cosine_schedule(tiny_path, tmp_path, ray_session):
    "num_epochs: the step count is computed from the data before the schedule is used."
    with SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=None, train__num_epochs=2, optim__schedule='cosine',
                             optim__warmup_steps=2, optim__lr=1e-3), train_data=ROWS) as t:
        assert t.total_steps == 2 * math.ceil(len(ROWS) / 8)
        h = t.fit()
    assert len(h) == t.total_steps
    assert h.lr.tolist() == pytest.approx([lr_at(s, 1e-3, t.total_steps, 'cosine', 2) for s in range(t.total_steps)])
    assert h.epoch.iloc[-1] < 2 and h.epoch.iloc[7] == 1.0


def test_export_loads_and_generates(tiny_path, tmp_path, ray_session):
    from transformers import AutoTokenizer, AutoModelForCausalLM
    with SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=2, placement__workers_per_node=2,
                             checkpoint__export_hf=True), train_data=ROWS) as t:
        t.train()
        w = weights(t)
    tok, model = AutoTokenizer.from_pretrained(tmp_path / 'hf'), AutoModelForCausalLM.from_pretrained(tmp_path / 'hf')
    sd = model.state_dict()
    assert all(sd[k].equal(v) for k, v in w.items() if k in sd)  # the export is the workers' weights, bit for bit
    ids = tok.apply_chat_template([{'role': 'user', 'content': 'Who are you?'}], add_generation_prompt=True, return_tensors='pt', return_dict=True)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids['input_ids'].shape[1]


def test_step_and_callback_stop(tiny_path, tmp_path, ray_session):
    class StopAt(Callback):
        def __init__(self): self.seen = []
        def on_step_end(self, trainer, metrics):
            self.seen.append(metrics['step'])
            if metrics['step'] == 2: trainer.control.should_stop = True
    cb = StopAt()
    with SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=5), callbacks=[cb], train_data=ROWS) as t:
        m = t.step()
        assert m['step'] == 1 and set(m) >= {'loss', 'grad_norm', 'lr', 'tokens_per_s', 'n_trained', 'epoch', 'step_time'}
        t.fit()
        assert t.global_step == 2 and cb.seen == [1, 2]
        t.fit(1)  # the flag was consumed: training continues on request
        assert t.global_step == 3
        assert list(t.metrics.step) == [1, 2, 3]


def test_prefetch_and_sampler_in_checkpoint(tiny_path, tmp_path, ray_session):
    "The next step's batch is collated during this step and equals a fresh collation; a resume under another sampler is refused."
    from sft_nb.config import ConfigError
    with SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=3, train__sampler='sequential'), train_data=ROWS) as t:
        t.step()
        (nxt, fut), = t.data.pending.items()
        assert nxt == 1
        (pre, *totals), (ref, *totals2) = fut.result(), t.data.rank_batches(t.data.global_batch(1))
        assert totals == totals2 and totals[-1] > 0
        for a, b in zip(pre[0], ref[0]): assert all(torch.equal(a[k], b[k]) for k in ('input_ids', 'labels'))
        ck = t.save()
    t2 = SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=3), train_data=ROWS)
    try:
        with pytest.raises(ConfigError, match="train.sampler: 'sequential' in the checkpoint's run, 'random' in this config"):
            t2.load(ck)
    finally: t2.shutdown()
    assert json.loads((ck / 'trainer_state.json').read_text())['global_step'] == 1  # the checkpoint is left as it was


def test_lora_adapter_only_exact_resume_and_both_exports(tiny_path, tmp_path, ray_session):
    """LoRA with dropout 0.3: the base weights stay as loaded; 2 steps + resume + 2 == 4 straight (the dropout masks
    after resume come from the checkpoint's RNG streams); the merged and the adapter-only exports give the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    lora = dict(model__lora_r=4, model__lora_dropout=0.3, train__num_steps=4)
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'straight', **lora), train_data=ROWS) as t:
        straight = t.fit()['loss'].tolist()
        trained = weights(t)
        merged = t.export(tmp_path / 'merged')
        t.cfg.checkpoint.lora_export = 'adapter'
        adapter = t.export(tmp_path / 'adapter')
    base = AutoModelForCausalLM.from_pretrained(tiny_path)
    base_sd = base.state_dict()
    frozen = {k: v for k, v in trained.items() if 'lora_' not in k}
    assert frozen and any('lora_' in k for k in trained)
    for k, v in frozen.items():
        assert torch.equal(v, base_sd[k.removeprefix('base_model.model.').replace('.base_layer', '')]), k

    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'half', **lora), train_data=ROWS) as t:
        t.fit(2); t.save()
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'half', checkpoint__resume='latest', **lora), train_data=ROWS) as t:
        resumed = t.fit()['loss'].tolist()
    assert resumed == straight, (resumed, straight)

    assert (adapter / 'adapter_config.json').exists() and not (adapter / 'model.safetensors').exists()
    ids = torch.tensor([[1, 5, 9, 20, 7, 3]])
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
        a = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), adapter).eval()(ids).logits
        b = base.eval()(ids).logits
    assert rel_gap(m, a) <= 1e-5 and rel_gap(m, b) > 1e-3


def test_a_finished_run_continues_in_place_as_a_resume_extends_it(tiny_path, tmp_path, ray_session):
    """A 4-step run, done, then `fit(2)`: it continues to 6 steps in the same workers (steps 1-4 as they were, 5-6 at the LR the
    6-step schedule gives, the event recorded), exactly as a resume of its step-4 checkpoint with train.num_steps=6 continues;
    that resume restores the eval points (the chart's) up to step 4."""
    base = dict(train__num_steps=4, train__eval_every=2, optim__schedule='cosine', optim__lr=1e-3, data__eval_fraction=0.25)
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'run', **base), train_data=ROWS) as t:
        first = t.fit()['loss'].tolist()
        ckpt = t.save()
        h = t.fit(2)
        assert t.total_steps == 6 and len(h) == 6 and h.loss.tolist()[:4] == first
        assert h.lr.tolist()[4:] == pytest.approx([lr_at(s, 1e-3, 6, 'cosine') for s in (4, 5)])
        assert [e['step'] for e in t.eval_metrics] == [2, 4, 6]
    events = [json.loads(l) for l in (tmp_path / 'run' / 'events.jsonl').read_text().splitlines()]
    assert events[-1]['event'] == 'continue' and events[-1]['changed'] == {'train.num_steps': [4, 6]} and 'lr_schedule' in events[-1]
    assert '# continued at step 4: train.num_steps 4 -> 6' in (tmp_path / 'run' / 'config.yaml').read_text()
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'resumed', checkpoint__resume=str(ckpt), **{**base, 'train__num_steps': 6}), train_data=ROWS) as r:
        assert [e['step'] for e in r.eval_metrics] == [2, 4]  # restored from the checkpoint: the chart keeps its eval points
        resumed = r.fit()['loss'].tolist()
    assert_rel_close(resumed[4:], h.loss.tolist()[4:], 4e-6, 'continued in place vs resumed')


def test_resume_latest_without_a_checkpoint_never_writes_over_a_run(tiny_path, tmp_path, ray_session):
    "A run folder whose run trained but never saved: `checkpoint.resume=latest` is refused by name, and its metrics stay as they were."
    from sft_nb.config import ConfigError
    with SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=4), train_data=ROWS) as t: t.fit(2)
    before = (tmp_path / 'metrics.jsonl').read_text()
    t = SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=4, checkpoint__resume='latest'), train_data=ROWS)
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=latest: .* holds a run \(2 steps in metrics\.jsonl\) but no checkpoint.*Save the trainer"):
        t.setup()
    assert (tmp_path / 'metrics.jsonl').read_text() == before and t.group is None


def test_a_trainer_set_up_again_goes_on_from_its_last_checkpoint(tiny_path, tmp_path, capfd):
    """`fit(3); shutdown(); fit()` on one trainer equals 6 steps straight: its new workers load the step-3 checkpoint
    (never the base weights at step 4). Steps trained after the last checkpoint are said to be lost, at shutdown and
    at setup, and the run goes on from that checkpoint's step, as a straight run would have (in process: the rule is the
    driver's, above the worker group)."""
    base = dict(train__num_steps=6, train__micro_batch_size=4, optim__schedule='cosine', placement__in_process=True)
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'straight', **base), train_data=ROWS) as t:
        straight = t.fit()['loss'].tolist()
    t = SFTTrainer(make_cfg(tiny_path, tmp_path / 'again', **base, checkpoint__save_every=2), train_data=ROWS)
    t.fit(3); t.shutdown()
    err = capfd.readouterr().err
    assert 'shutdown: the weights of step 3 are not saved (trainer.save() before shutdown keeps them)' in err, err
    losses = t.fit()['loss'].tolist(); t.shutdown()
    err += capfd.readouterr().err
    assert 'set up again: the weights of step 3 were not saved and are gone; the run goes on from step 2 (step_000002)' in err, err
    assert_rel_close(losses, straight, 4e-6, 'set up again vs straight')
    lines = [json.loads(l) for l in (tmp_path / 'again' / 'metrics.jsonl').read_text().splitlines()]
    assert [l['step'] for l in lines if l['kind'] == 'train'] == [1, 2, 3, 4, 5, 6]  # step 3 once, as trained again


def test_an_interrupt_during_a_save_waits_for_it(tiny_path, tmp_path):
    """Ctrl-C while an in-process worker writes a checkpoint: the save finishes, then a `KeyboardInterrupt` says so; the
    checkpoint is complete and the workers live on (never torch's `CheckpointException` from a half-written folder)."""
    import os, signal
    t = SFTTrainer(make_cfg(tiny_path, tmp_path, train__num_steps=2, placement__in_process=True), train_data=ROWS)
    try:
        t.fit(1)
        worker, real = t.group.actors[0], t.group.actors[0].save
        def interrupted_save(path):
            os.kill(os.getpid(), signal.SIGINT)  # lands while the worker saves, in this (the main) thread
            return real(path)
        worker.save = interrupted_save
        with pytest.raises(KeyboardInterrupt, match='interrupted during the save of step 1, which finished first'): t.save()
        assert [p.name for p in t.checkpoints()] == ['step_000001']
        assert t.step()['step'] == 2
    finally: t.shutdown()


def test_run_all_without_a_step_leaves_one_run_folder(tiny_path, tmp_path):
    """A notebook's Run All twice without a step leaves one run folder: the retired trainer deletes the one it made and
    ran nothing in. A trainer that trained and saved a step keeps its folder when retired."""
    from sft_nb.trainer import retire
    cfg = lambda name: make_cfg(tiny_path, tmp_path / name, placement__in_process=True, train__num_steps=2)
    trainer = None
    for name in ('first', 'second'):  # each Run All: retire the last trainer, set up a new one
        retire(trainer); trainer = SFTTrainer(cfg(name), train_data=ROWS).setup()
    assert [p.name for p in tmp_path.iterdir()] == ['second']
    trainer.step(); trainer.save(); retire(trainer)
    assert sorted(p.name for p in (tmp_path / 'second').iterdir()) == ['checkpoints', 'config.yaml', 'metrics.jsonl']
