"""Chunked LM head + cross-entropy (`model.loss_chunk`, sft_nb.loss) equals the one-shot loss: the Function on its own, the
FSDP worker's gradients (tied head, LoRA-wrapped head, weights, packed), a whole trainer step on 2 FSDP2 ranks, and
megatron's chunked vocab-parallel loss against FSDP. The worker's FlexAttention eval on packed rows equals the dense-mask path.
The worker's objective: its micro-batches and ranks all divide by the step's weight_sum (by hand on a Hugging Face
forward; 2 ranks == 1)."""
import pytest
import torch
import torch.nn.functional as F
from sft_nb.config import ModelConfig, OptimConfig, ConfigError
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.demo_data import identity_rows
from sft_nb.loss import linear_nll, chunked_nll, resolve_attn_implementation, flex_attention_runs_on
from sft_nb.trainer import SFTTrainer
from sft_nb.numerics import assert_rel_close, rel_gap
from helpers import run_cfg, spawn, step_grads, view_warnings

ROWS = identity_rows()['train']
WROWS = [{'messages': [{**m, 'loss_weight': [0.25, 1, 2.5, 0.5][k % 4]} if m['role'] == 'assistant' else m for m in r['messages']]}
         for k, r in enumerate(ROWS)]
needs_cpu_flex = pytest.mark.skipif(not flex_attention_runs_on('cpu'), reason="torch refuses to compile FlexAttention on a CPU capability of DEFAULT")
TOL = 1e-6  # of the compared value's magnitude (~8 fp32 ulps): only the order of the sums differs
GRAD_TOL = 4e-6  # gradients of a whole model: the head's rounding passes through every layer's backward


def test_config():
    m = ModelConfig()
    assert m.attn_implementation == 'auto' and m.loss_chunk > 0
    assert resolve_attn_implementation(m.attn_implementation, 'cpu') == 'sdpa'  # CPU keeps sdpa + the dense mask
    with pytest.raises(ConfigError, match='loss_chunk'): ModelConfig(loss_chunk=-1)


@pytest.mark.parametrize('chunk', [1, 8, 37, 100, 0])
@pytest.mark.parametrize('weighted', [False, True])
def test_linear_nll_equals_cross_entropy(chunk, weighted):
    "37 tokens (not a multiple of 8), with and without fractional weights: loss and the gradients of h, W, b."
    torch.manual_seed(1)
    h, W, b = torch.randn(37, 24), torch.randn(91, 24), torch.randn(91)
    t, w = torch.randint(0, 91, (37,)), (torch.rand(37) * 3 if weighted else None)
    def run(fn):
        xs = [x.clone().requires_grad_() for x in (h, W, b)]
        loss = fn(*xs); loss.backward()
        return float(loss), [x.grad for x in xs]
    def ref(h, W, b):
        nll = F.cross_entropy(F.linear(h, W, b), t, reduction='none')
        return nll.sum() if w is None else (nll * w).sum()
    l0, g0 = run(ref)
    l1, g1 = run(lambda h, W, b: linear_nll(h, W, t, w, b, chunk=chunk))
    assert abs(l1 - l0) <= TOL * abs(l0)
    assert_rel_close(g1, g0, TOL, 'gradients of h, W, b')
    with torch.no_grad(): assert abs(float(linear_nll(h, W, t, w, b, chunk=chunk)) - l0) <= TOL * abs(l0)  # eval: no saved state needed


def test_no_trained_token_keeps_graph():
    h, W = torch.randn(0, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    loss = linear_nll(h, W, torch.zeros(0, dtype=torch.long), chunk=4)
    loss.backward()
    assert float(loss) == 0 and float(W.grad.abs().sum()) == 0


@pytest.fixture(scope='module')
def worker(tiny_path):
    "One in-process FSDP worker (1-rank gloo group); tests switch its `loss_chunk`."
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.workers import free_port
    w = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path)), OptimConfig(lr=1e-3), total_steps=3)
    w.init_dist('127.0.0.1', free_port())
    w.setup()
    yield w
    w.shutdown()


def batches(tok, weighted):
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset((WROWS if weighted else ROWS)[:6], tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    return {'padded': collate_padded(exs, tok.pad_token_id), 'packed': collate_packed([exs[:3], exs[3:]], tok.pad_token_id)}


@pytest.mark.parametrize('weighted', [False, True])
def test_worker_chunked_equals_one_shot(worker, tiny_tok, weighted):
    "The FSDP worker (tied head): Σ NLL, the count and every parameter's gradient, chunks of 5 and 7 tokens vs 0 (off)."
    assert worker.model.get_output_embeddings().weight is worker.model.get_input_embeddings().weight  # tied
    for name, mb in batches(tiny_tok, weighted).items():
        assert ('loss_weights' in mb) == weighted
        r0, g0 = step_grads(worker, [mb], mb.get('weight_sum', mb['n_trained']), 0)
        for chunk in (5, 7):
            r1, g1 = step_grads(worker, [mb], mb.get('weight_sum', mb['n_trained']), chunk)
            assert r1['weight_sum'] == r0['weight_sum'] and mb['n_trained'] % chunk != 0
            assert abs(r1['nll_sum'] - r0['nll_sum']) <= TOL * r0['nll_sum'], (name, r0, r1)
            assert g1.keys() == g0.keys()
            assert_rel_close(g1, g0, GRAD_TOL, f'{name}, chunks of {chunk}: gradients')
        with torch.no_grad():
            worker.loss_chunk = 5
            assert abs(worker.eval_loss([mb])['nll_sum'] - r0['nll_sum']) <= TOL * r0['nll_sum']


@pytest.mark.parametrize('weighted', [False, True])
def test_micro_batches_share_the_step_divisor(worker, tiny_path, tiny_tok, weighted):
    """Two micro-batches (padded, packed) accumulate the gradient of Σ weight·NLL over both / the step's weight_sum: that
    of the same objective written by hand on a plain Hugging Face forward (log-softmax of its logits at t, the label at
    t + 1, -100 skipped)."""
    from transformers import AutoModelForCausalLM
    from sft_nb.collate import model_inputs
    mbs = list(batches(tiny_tok, weighted).values())
    n = sum(mb.get('weight_sum', mb['n_trained']) for mb in mbs)
    r, got = step_grads(worker, mbs, n)
    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    nll = 0
    for mb in mbs:
        logp, tgt = torch.log_softmax(ref(**model_inputs(mb)).logits.float(), -1)[:, :-1], mb['labels'][:, 1:]
        keep = tgt != -100
        w = mb['loss_weights'][:, 1:][keep] if weighted else 1
        nll = nll - (logp[keep].gather(1, tgt[keep][:, None])[:, 0] * w).sum()
    (nll / n).backward()
    assert r['weight_sum'] == n and abs(r['nll_sum'] - float(nll.detach())) <= 1e-5 * float(nll.detach())
    assert_rel_close(got, {k: p.grad for k, p in ref.named_parameters()}, GRAD_TOL, 'gradients of both micro-batches')


def test_two_ranks_equal_one_rank(worker, tiny_path, tiny_tok):
    """2 FSDP ranks (spawned processes, a gloo group), one micro-batch each (packed, padded), both dividing by the step's
    weight_sum: the gradient FSDP reduces over the ranks equals one rank's gradient of both micro-batches, for the whole
    model (the head at the trained positions in chunks of 7, and in one piece) and for LoRA adapters on attention and the
    (tied) LM head, in chunks of 7.
    No sharded module returns a view (FSDP2 warns on one: an in-place op on it would drop the hook whose all-gather the
    head's backward needs)."""
    from sft_nb.backends.fsdp import FSDPWorker
    mbs = list(batches(tiny_tok, True).values())
    n = sum(mb['weight_sum'] for mb in mbs)
    assert all(mb['n_trained'] > 7 and mb['n_trained'] % 7 for mb in mbs)  # several chunks, a short last one
    full, one_shot = ModelConfig(path=str(tiny_path), loss_chunk=7), ModelConfig(path=str(tiny_path), loss_chunk=0)
    lora = ModelConfig(path=str(tiny_path), loss_chunk=7, lora_r=4, lora_target_modules=['q_proj', 'v_proj', 'lm_head'])
    worker.loss_chunk = full.loss_chunk
    _, one = step_grads(worker, mbs, n)
    worker.loss_chunk = one_shot.loss_chunk
    _, one_0 = step_grads(worker, mbs, n)
    lw = FSDPWorker(0, 1, lora, OptimConfig(), total_steps=1)  # in this process's 1-rank group (the `worker` fixture's)
    lw.setup()
    _, one_lora = step_grads(lw, mbs, n)
    keep = ('input_ids', 'labels', 'attention_mask', 'position_ids', 'loss_weights')
    (r, two, _, _), (r0, two_0, _, _), (rl, two_lora, _, _) = spawn(2, 1, [full, one_shot, lora],
                                                                     [[{k: mb[k] for k in keep}] for mb in mbs], n)
    assert_rel_close(two, one, GRAD_TOL, '2 ranks vs 1: gradients')
    assert_rel_close(two_0, one_0, GRAD_TOL, '2 ranks vs 1, the head in one piece: gradients')
    assert two_lora.keys() == one_lora.keys() and any('lm_head' in k for k in one_lora)
    assert_rel_close(two_lora, one_lora, GRAD_TOL, '2 ranks vs 1, LoRA: gradients')
    views = [m for x in (r, r0, rl) for m in view_warnings(x)]
    assert not views, views


def test_lora_wrapped_head(tiny_path, tiny_tok):
    "LoRA on lm_head too: the head is a peft wrapper, not an nn.Linear, so each chunk is checkpointed; same gradients."
    from transformers import AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model
    from sft_nb.loss import trained_targets, target_weights
    from sft_nb.collate import model_inputs
    from sft_nb.loss import TrainedHead
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=['q_proj', 'lm_head'], init_lora_weights=False))
    head = model.get_output_embeddings()
    assert not isinstance(head, torch.nn.Linear)
    mb = batches(tiny_tok, True)['packed']
    sel, tgt = trained_targets(mb['labels'])
    wt = target_weights(mb['labels'], mb['loss_weights'])
    def run(chunk):
        model.zero_grad()
        with TrainedHead(head, sel, tgt, wt, chunk) as th: s, n = th.nll(model(**model_inputs(mb)).logits, mb['labels'], mb['loss_weights'])
        (s / n).backward()  # the training scale: gradients of the mean loss
        return float(s), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    (s0, g0), (s1, g1) = run(0), run(6)
    assert any('lm_head' in k for k in g0) and g0.keys() == g1.keys()
    assert abs(s1 - s0) <= TOL * s0
    assert_rel_close(g1, g0, GRAD_TOL, 'LoRA gradients')


def _step(tiny_path, run_dir, **kw):
    "One trainer step of packed rows with fractional weights under Ray (this module's in-process `worker` holds this process's gloo group): (metrics, weights)."
    cfg = run_cfg(tiny_path, run_dir, **{'optim__max_grad_norm': 0.0, 'optim__lr': 1e-3, 'optim__eps': 1e-5, 'packing__enabled': True,
                                         'packing__capacity': 128, 'tokenize__max_length': 64, 'train__global_batch_size': 4,
                                         'train__micro_batch_size': 1, 'placement__workers_per_node': 2, **kw})
    with SFTTrainer(cfg, train_data=WROWS) as t:
        m = t.step()
        return m, t.group.call('full_state')[0]


@pytest.fixture(scope='module')
def one_shot_step(tiny_path, tmp_path_factory, ray_session):
    "The reference: one step on 2 FSDP2 ranks with the one-shot loss (`loss_chunk: 0`)."
    return _step(tiny_path, tmp_path_factory.mktemp('one_shot'), model__loss_chunk=0)


def test_trainer_step_chunked_equals_one_shot(tiny_path, tmp_path, one_shot_step):
    "One step on 2 FSDP2 ranks (sharded head), packed rows with fractional weights: loss, grad norm and every weight."
    m0, w0 = one_shot_step
    m1, w1 = _step(tiny_path, tmp_path / 'on', model__loss_chunk=7)
    assert m0['n_trained'] == m1['n_trained']
    assert abs(m1['loss'] - m0['loss']) <= TOL * m0['loss'] and abs(m1['grad_norm'] - m0['grad_norm']) <= TOL * m0['grad_norm']
    print(f"chunked vs one-shot: |Δloss| {abs(m1['loss'] - m0['loss']):.1e}, |Δgrad_norm| {abs(m1['grad_norm'] - m0['grad_norm']):.1e}, weights {rel_gap(w1, w0, scale=1e-3):.1e} of one update")
    assert_rel_close(w1, w0, 1e-3, 'weights after one step', scale=1e-3)  # in units of the step's update (lr: Adam)


@pytest.mark.parametrize('layout', ['tp1', 'tp2'])
def test_megatron_chunked_equals_fsdp(tiny_path, tmp_path, one_shot_step, layout):
    "Megatron with its chunked vocab-parallel loss (chunks of 7 trained tokens) == FSDP with the one-shot loss, one step."
    pytest.importorskip('megatron.core')
    m0, w0 = one_shot_step
    lay = {'placement__tensor_parallel': 2} if layout == 'tp2' else {'placement__workers_per_node': 1, 'train__micro_batch_size': 2}
    m1, w1 = _step(tiny_path, tmp_path / layout, model__loss_chunk=7, placement__backend='megatron', **lay)
    assert abs(m1['loss'] - m0['loss']) <= 4e-6 * m0['loss'] and abs(m1['grad_norm'] - m0['grad_norm']) <= 1e-5 * m0['grad_norm']
    assert_rel_close(w1, w0, 1e-2, 'weights after one step', scale=1e-3)  # of one update (lr); test_megatron's 5-step bound is 2e-2


@needs_cpu_flex
def test_worker_flex_attention_eval_equals_sdpa(worker, tiny_tok):
    """The FSDP worker's flex_attention path on a packed batch (the dense mask swapped for a document BlockMask in `to_device`)
    evaluates to the same Σ NLL as sdpa + the dense mask (eval only: FlexAttention has no CPU backward). The model-level
    logits of flex vs sdpa on packed rows: nbs/06c_loss.ipynb."""
    mb = batches(tiny_tok, True)['packed']
    worker.loss_chunk = 2048
    ref = worker.eval_loss([mb])
    try:
        worker.attn = 'flex_attention'; worker.model.set_attn_implementation('flex_attention')
        assert type(worker.to_device(mb)['attention_mask']).__name__ == 'BlockMask'
        out = worker.eval_loss([mb])
    finally:
        worker.attn = 'sdpa'; worker.model.set_attn_implementation('sdpa')
    assert out['weight_sum'] == ref['weight_sum'] and abs(out['nll_sum'] - ref['nll_sum']) <= 1e-5 * ref['nll_sum']
