"""Distillation (`train.loss: kd`, sft_nb.loss.KD) on the FSDP worker, the tiny ChatML student and a tiny Llama teacher of the
same tokenizer: chunked equals one-shot, packed equals padded, 2 ranks equal 1, a resumed run equals a straight one; a
teacher of another tokenizer is refused by name, and so is kd on the megatron backend. Offline (`train.teacher_cache`,
written by `sft-nb teacher-topk`): the top-k of the whole vocabulary trains as the online teacher does, padded, packed, on
2 ranks and through the trainer; a cache of another teacher or other tokenized data is refused by name. The loss itself
(a one-hot teacher at α = 0 is the NLL, the divergences, T², the stored top-k) is checked in nbs/06c_loss.ipynb."""
import json
from contextlib import contextmanager
import pytest
import torch
import yaml
from sft_nb.config import ModelConfig, OptimConfig, TrainConfig, ConfigError
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.demo_data import identity_rows
from sft_nb.numerics import assert_rel_close
from sft_nb.trainer import SFTTrainer
from helpers import cli, run_cfg, spawn, step_grads

ROWS = identity_rows()['train']
WROWS = [{'messages': [{**m, 'loss_weight': [0.25, 1, 2.5, 0.5][k % 4]} if m['role'] == 'assistant' else m for m in r['messages']]}
         for k, r in enumerate(ROWS)]
TOL, GRAD_TOL = 1e-6, 4e-6  # as tests/test_loss.py: only the order of the sums differs


def kd(teacher, **kw) -> TrainConfig:
    "A distillation config that exercises every term: JSD, a temperature, a share of NLL."
    return TrainConfig(**{'loss': 'kd', 'teacher': str(teacher), 'kd_divergence': 'jsd', 'kd_beta': 0.3,
                          'kd_temperature': 2.0, 'kd_alpha': 0.25, **kw})


def test_kd_resume_is_exact(tiny_path, tiny_llama_path, tmp_path):
    """4 KD steps straight == 2 steps, save, a new trainer resumed from that checkpoint, 2 more (in process: no Ray).
    First in this module: an in-process trainer needs a process without the `kd_worker` fixture's process group."""
    base = dict(train__num_steps=4, train__micro_batch_size=4, optim__schedule='cosine', optim__max_grad_norm=0.0,
                placement__in_process=True, train__loss='kd', train__teacher=str(tiny_llama_path), train__kd_alpha=0.5)
    with SFTTrainer(run_cfg(tiny_path, tmp_path / 'straight', **base), train_data=ROWS) as t:
        straight = t.fit()['loss'].tolist()
    with SFTTrainer(run_cfg(tiny_path, tmp_path / 'half', **base), train_data=ROWS) as t:
        t.fit(2); ckpt = t.save()
    with SFTTrainer(run_cfg(tiny_path, tmp_path / 'resumed', **base, checkpoint__resume=str(ckpt)), train_data=ROWS) as r:
        assert r.global_step == 2
        resumed = r.fit()['loss'].tolist()
    assert resumed[:2] == straight[:2]
    assert_rel_close(resumed[2:], straight[2:], 4e-6, 'resumed KD losses')


def fkl(teacher, **kw) -> TrainConfig:
    "Forward-KL distillation (what a top-k cache trains) with a temperature and a share of NLL."
    return TrainConfig(**{'loss': 'kd', 'teacher': str(teacher), 'kd_temperature': 2.0, 'kd_alpha': 0.25, **kw})


def test_offline_top_k_trains_as_online_and_a_cache_of_another_teacher_or_tokenization_is_refused(
        tiny_path, tiny_llama_path, tiny_tok, tmp_path):
    """`sft-nb teacher-topk` stores the tiny Llama's top-k of the whole vocabulary; 2 packed steps trained from it, without
    the teacher, have the online run's losses, and resumed after a step the straight run's. Before a step, a run refuses
    the cache with another train.teacher (its weights) or with other tokenized data (tokenize.max_length and truncation),
    naming what differs. In process, no Ray:
    before the `kd_worker` fixture's process group."""
    from sft_nb.trainer import SFTTrainer
    rows = tmp_path / 'rows.jsonl'
    rows.write_text(''.join(json.dumps(r) + '\n' for r in ROWS[:16]))
    cache = tmp_path / 'topk'
    base = run_cfg(tiny_path, tmp_path / 'online', train__num_steps=2, train__micro_batch_size=4, packing__enabled=True,
                   tokenize__max_length=64, optim__max_grad_norm=0.0, placement__in_process=True, data__train=[{'path': str(rows)}],
                   data__eval_fraction=0.25,
                   **{f'train__{k}': v for k, v in vars(fkl(tiny_llama_path)).items() if k.startswith(('loss', 'teacher', 'kd_'))})
    (tmp_path / 'kd.yaml').write_text(yaml.safe_dump(base))
    code, out, err = cli('teacher-topk', tmp_path / 'kd.yaml', '--out', cache, '--k', len(tiny_tok))
    assert code == 0, err
    assert json.loads(out)['k'] == len(tiny_tok) and not list(tmp_path.glob('.topk.tmp*'))  # nothing left aside
    with SFTTrainer(base) as t: online = t.fit()['loss'].tolist()
    off = lambda d, **kw: {**base, 'checkpoint': {**base['checkpoint'], 'run_dir': str(tmp_path / d)},
                           'train': {**base['train'], 'teacher_cache': str(cache), **kw.pop('train', {})}, **kw}
    with SFTTrainer(off('offline')) as t:
        assert t.setup().group.actors[0].teacher is None  # no teacher in memory
        offline = t.fit()['loss'].tolist()
    assert_rel_close(offline, online, 1e-5, 'offline top-k = V vs online KD losses')
    with SFTTrainer(off('half')) as t:
        t.fit(1); ckpt = t.save()
    with SFTTrainer(off('resumed', checkpoint={**base['checkpoint'], 'run_dir': str(tmp_path / 'resumed'),
                                               'resume': str(ckpt)})) as t:
        assert t.fit()['loss'].tolist()[1:] == offline[1:]  # resumed: the same rows, the same top-k
        assert t.evaluate()['eval_loss'] > 0  # the held-out rows' NLL: no teacher needed
    import re
    with pytest.raises(ConfigError, match=re.escape(f"train.teacher_cache: {cache} was written by another teacher: "
                                                    f"{tiny_llama_path} (weights ") + ".*" +
                                          re.escape(f"not train.teacher {tiny_path} (weights ")):
        SFTTrainer(off('other_teacher', train={'teacher': str(tiny_path)})).setup()
    with pytest.raises(ConfigError, match=r"written from other tokenized data: data.train\[0\].content is .* \(tokenize "
                                          "settings: tokenize.max_length is 64 there, 40 here; tokenize.truncation is 'drop' "
                                          r"there, 'keep_start' here\); write it for this run: sft-nb teacher-topk"):
        SFTTrainer(off('other_tokens', tokenize={'max_length': 40, 'truncation': 'keep_start'})).setup()


@pytest.fixture(scope='module')
def kd_worker(tiny_path, tiny_llama_path):
    "One in-process FSDP worker (1-rank gloo group) distilling the tiny Llama into the tiny ChatML model."
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.workers import free_port
    w = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path)), OptimConfig(lr=1e-3), total_steps=3, train=kd(tiny_llama_path))
    w.init_dist('127.0.0.1', free_port())
    w.setup()
    yield w
    w.shutdown()


def layouts(tok, topk=lambda i: {}):
    "The same 6 weighted rows as one padded and one packed micro-batch (each row with `topk(i)`: its stored top-k)."
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(WROWS[:6], tok, TokenizeConfig(max_length=64))
    exs = [dict(r) | topk(i) for i, r in enumerate(ds)]
    return {'padded': collate_padded(exs, tok.pad_token_id), 'packed': collate_packed([exs[:3], exs[3:]], tok.pad_token_id)}


def test_kd_chunked_equals_one_shot_and_packed_equals_padded(kd_worker, tiny_tok):
    """The KD loss and every student gradient: chunks of 7 targets equal the one-shot head (both models' [n_trained, V]
    logits at once), and the packed micro-batch equals the padded one. The teacher is frozen (no gradient, no optimizer
    state), evaluation reports the NLL, not the KD loss, and the lens's per-token losses are the KD loss's."""
    w, mbs = kd_worker, layouts(tiny_tok)
    n = mbs['padded']['weight_sum']
    assert n == mbs['packed']['weight_sum'] and mbs['padded']['n_trained'] % 7
    ref = step_grads(w, [mbs['padded']], n, 0)
    for name, chunk in (('padded', 7), ('packed', 0), ('packed', 7)):
        r, g = step_grads(w, [mbs[name]], n, chunk)
        assert r['weight_sum'] == ref[0]['weight_sum']
        assert abs(r['nll_sum'] - ref[0]['nll_sum']) <= TOL * ref[0]['nll_sum'], (name, chunk, r, ref[0])
        assert_rel_close(g, ref[1], GRAD_TOL, f'{name}, chunks of {chunk}: KD gradients')
    assert not any(p.requires_grad for p in w.teacher.parameters())
    assert {id(p) for p in w.teacher.parameters()}.isdisjoint(id(p) for grp in w.opt.param_groups for p in grp['params'])
    w.loss_chunk = 7
    from sft_nb.loss import NLL
    with torch.no_grad(): nll = float(w.nll(w.to_device(mbs['padded']), objective=NLL())[0])
    assert abs(w.eval_loss([mbs['padded']])['nll_sum'] - nll) <= TOL * nll
    assert abs(nll - ref[0]['nll_sum']) > 1e-3 * nll  # the KD loss is another number
    # the lens's per-token values come from the same loss: weighted, they add up to the step's KD sum
    from sft_nb.loss import target_weights
    st = w.token_losses([mbs['padded']], k=2)[0]
    wt = target_weights(mbs['padded']['labels'], mbs['padded']['loss_weights']).numpy()
    assert abs(float((st['loss'] * wt).sum()) - ref[0]['nll_sum']) <= 1e-5 * ref[0]['nll_sum']
    assert st['teacher_ids'].shape == st['top_ids'].shape == (mbs['padded']['n_trained'], 2)


@pytest.fixture(scope='module')
def topk_layouts(tiny_path, tiny_llama_path, tiny_tok, tmp_path_factory):
    "`layouts`' micro-batches carrying the tiny Llama's top-k of the whole vocabulary, and the cache's folder."
    from sft_nb.config import SFTConfig
    from sft_nb.loss import write_teacher_topk
    from sft_nb.topk import TopKCache
    folder = tmp_path_factory.mktemp('kd') / 'topk'
    cfg = SFTConfig(model=ModelConfig(path=str(tiny_path)), train=fkl(tiny_llama_path))
    cfg.tokenize.max_length = 64
    cache = TopKCache(folder, write_teacher_topk(cfg, folder, k=len(tiny_tok), train_data=WROWS[:6], batch_size=4))
    return layouts(tiny_tok, lambda i: cache.row(0, i)), folder


@contextmanager
def offline(w, folder):
    "The worker distilling from the cache at `folder`: forward KL, no teacher (then the online teacher again)."
    was = w.tcfg, w.teacher
    w.tcfg, w.teacher = fkl(w.tcfg.teacher, teacher_cache=str(folder)), None
    try: yield w
    finally: w.tcfg, w.teacher = was


def test_top_k_of_the_whole_vocabulary_equals_online(kd_worker, topk_layouts, tiny_llama_path):
    """Forward-KL KD from the stored top-k at k = V equals the online teacher's, loss and every student gradient, on the
    padded and the packed micro-batch, in chunks of 7 targets and one-shot; the lens reads the stored teacher's top tokens;
    the empty micro-batch (no top-k: nothing trained) runs."""
    mbs, folder = topk_layouts
    n = mbs['padded']['weight_sum']
    kd_worker.tcfg, was = fkl(tiny_llama_path), kd_worker.tcfg
    try: ref = step_grads(kd_worker, [mbs['padded']], n, 0)
    finally: kd_worker.tcfg = was
    with offline(kd_worker, folder) as w:
        for name, chunk in (('padded', 0), ('padded', 7), ('packed', 0), ('packed', 7)):
            r, g = step_grads(w, [mbs[name]], n, chunk)
            assert_rel_close(r['nll_sum'], ref[0]['nll_sum'], 2e-6, f'{name}, chunks of {chunk}: offline KD loss')
            assert_rel_close(g, ref[1], 1e-5, f'{name}, chunks of {chunk}: offline KD gradients')
        st = w.token_losses([mbs['padded']], k=2)[0]
        empty = collate_padded([{'input_ids': [0, 0], 'loss_mask': [0, 0]}], 0)  # a rank with nothing left: no top-k
        assert step_grads(w, [empty], n, 7)[0]['nll_sum'] == 0
    assert (st['teacher_ids'] == mbs['padded']['teacher_ids'][:, :2].numpy()).all()


def test_kd_two_ranks_equal_one_rank(kd_worker, topk_layouts, tiny_path, tiny_llama_path, tiny_tok):
    """2 FSDP ranks (spawned, gloo), one micro-batch each (padded, packed), the student and the teacher sharded (the
    teacher's tied head whole on each rank): the reduced KD gradient equals one rank's over both micro-batches; and so
    does offline KD's, from the micro-batches' stored top-k (each rank gets its own rows' top-k)."""
    topk, folder = topk_layouts
    mbs = list(topk.values())
    n = sum(mb['weight_sum'] for mb in mbs)
    _, one = step_grads(kd_worker, mbs, n, 7)
    with offline(kd_worker, folder) as w: _, one_offline = step_grads(w, mbs, n, 7)
    keep = ('input_ids', 'labels', 'attention_mask', 'position_ids', 'loss_weights', 'teacher_ids', 'teacher_logp')
    [(r, two, _, _), (_, two_offline, _, _)] = spawn(
        2, 1, [(ModelConfig(path=str(tiny_path), loss_chunk=7), kd(tiny_llama_path)),
               (ModelConfig(path=str(tiny_path), loss_chunk=7), fkl(tiny_llama_path, teacher_cache=str(folder)))],
        [[{k: mb[k] for k in keep}] for mb in mbs], n)
    assert_rel_close(two, one, GRAD_TOL, 'KD, 2 ranks vs 1: gradients')
    assert_rel_close(two_offline, one_offline, GRAD_TOL, 'offline KD, 2 ranks vs 1: gradients')


def test_a_teacher_of_another_tokenizer_is_refused(tiny_path, tiny_llama_path, tmp_path):
    """The worker refuses, before training, a teacher whose tokenizer differs, naming the first id that differs; and the
    megatron backend refuses train.loss kd by name."""
    import shutil
    from transformers import AutoTokenizer
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.backends.megatron import MegatronWorker
    other = tmp_path / 'other_teacher'
    shutil.copytree(tiny_llama_path, other)
    tok = AutoTokenizer.from_pretrained(other); tok.add_tokens(['<teacher_only>']); tok.save_pretrained(other)
    w = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path)), OptimConfig(), total_steps=1, train=kd(other))
    with pytest.raises(ConfigError, match=f"train.teacher: .*id {len(tok) - 1} is '<teacher_only>' for the teacher"): w.setup()
    m = MegatronWorker(0, 1, ModelConfig(path=str(tiny_path)), OptimConfig(), total_steps=1, train=kd(tiny_llama_path))
    with pytest.raises(ConfigError, match="train.loss: 'kd' is not supported by the megatron backend"): m.setup()
