"""Megatron-core backend on CPU/gloo: HF↔Megatron conversion, logits parity, TP/PP/DP losses equal FSDP's through SFTTrainer, exact resume."""
import pytest
import torch
from sft_nb.numerics import assert_rel_close, rel_gap
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer
from helpers import local_run, run_cfg

pytest.importorskip('megatron.core')
ROWS = identity_rows()['train']
WROWS = [{'messages': [{**m, 'loss_weight': [0.25, 1, 2.5, 0.5][k % 4]} if m['role'] == 'assistant' else m for m in r['messages']]}
         for k, r in enumerate(ROWS)]  # fractional loss weights
STEPS = 5


def make_cfg(tiny_path, run_dir, **kw):
    "Cosine schedule with warmup and clipping over STEPS steps, micro-batches of 2."
    return run_cfg(tiny_path, run_dir, **{'optim__lr': 1e-3, 'optim__schedule': 'cosine', 'optim__max_grad_norm': 1.0,
                                          'optim__warmup_steps': 1, 'train__micro_batch_size': 2, 'train__num_steps': STEPS, **kw})


def in_process_worker(path, **placement):
    "A 1-rank MegatronWorker in this process (its own gloo group)."
    from sft_nb.backends.megatron import MegatronWorker
    from sft_nb.config import ModelConfig, OptimConfig, PlacementConfig
    from sft_nb.workers import free_port
    w = MegatronWorker(0, 1, ModelConfig(path=str(path)), OptimConfig(), total_steps=1, placement=PlacementConfig(backend='megatron', **placement))
    w.init_dist('127.0.0.1', free_port())
    w.setup()
    return w


def _logits_match(path, length=32):
    # HF 'eager' attention is the same arithmetic as megatron's local attention; HF's own sdpa and eager
    # differ by ~1e-4 on SmolLM2-135M (logits up to ~34; fp32 vs fp64 differs by 8e-5), so compare with eager
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation='eager').eval()
    w = in_process_worker(path)
    try:
        ids = torch.randint(0, hf.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(): ref = hf(ids).logits
        diff = rel_gap(w.logits(ids), ref)
        back = w.full_state()
        exact = all(back[k].equal(v) for k, v in hf.state_dict().items())
    finally: w.shutdown()
    return diff, exact


def test_logits_equal_hf_llama(tiny_llama_path):
    "The tiny Llama (SmolLM2-135M-Instruct's architecture: no attention bias, 9 heads, 3 KV heads, tied): converted logits equal HF's, and the weights convert back exactly (the tiny Qwen2: nbs/07b)."
    diff, exact = _logits_match(tiny_llama_path)
    print(f'Llama logits: {diff:.2e} of their size')
    assert diff <= 1e-5 and exact


def _streams(w, prompt):
    "What a worker streams for `prompt` (greedy in pieces of 1, 3 and 8 tokens; sampled; up to an EOS) and its greedy `generate`."
    with pytest.raises(RuntimeError, match='no continuation was started'): w.stream_tokens(None, 2)
    greedy = w.stream_tokens(prompt, 1) + w.stream_tokens(None, 3) + w.stream_tokens(None, 8)
    eos = greedy[2]  # as if the third greedy token were the EOS
    sampled = w.stream_tokens(prompt, 12, temperature=1.5, top_p=0.95, seed=3)
    to_eos = w.stream_tokens(prompt, 12, eos_token_id=eos)
    return {'greedy': greedy, 'sampled': sampled, 'eos': eos, 'to_eos': to_eos, 'after_eos': w.stream_tokens(None, 4),
            'generate': w.generate([prompt], 12)[0]}


def test_stream_tokens_equal_fsdp(tiny_path, tmp_path):
    """MegatronWorker.stream_tokens (what the panel's chat calls; it recomputes the prefix each token) streams what the FSDP worker
    streams (KV cache) on the same tiny weights: greedy in pieces equals greedy all at once and each backend's `generate`, a seeded
    sampled reply is the same tokens on both, a reply ends at its EOS (then nothing more)."""
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    from sft_nb.workers import free_port
    from transformers import AutoTokenizer
    from transformers import AutoModelForCausalLM
    m, g = AutoModelForCausalLM.from_pretrained(tiny_path), torch.Generator().manual_seed(0)
    with torch.no_grad():  # the tiny model's own init answers 670 forever: weights of std 0.1 make each token depend on the prefix
        for q in m.parameters():
            if q.dim() > 1: q.copy_(torch.randn(q.shape, generator=g) * 0.1)
    path = tmp_path / 'model'; m.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(tiny_path); tok.save_pretrained(path)
    prompt = tok.apply_chat_template([{'role': 'user', 'content': 'Who are you?'}], add_generation_prompt=True, tokenize=True, return_dict=True)['input_ids']
    w = in_process_worker(path)
    try: mega = _streams(w, prompt)
    finally: w.shutdown()
    f = FSDPWorker(0, 1, ModelConfig(path=str(path)), OptimConfig(), total_steps=1)
    f.init_dist('127.0.0.1', free_port()); f.setup()
    try: fsdp = _streams(f, prompt)
    finally: f.shutdown()
    print('megatron', mega, '\nfsdp', fsdp)
    assert mega == fsdp
    assert len(set(mega['greedy'])) >= 6 and mega['greedy'] == mega['generate']  # a reply that moves, not one token repeated
    assert mega['sampled'] != mega['greedy']  # temperature 1.5 on a random model: another reply, the same on both backends
    assert mega['to_eos'] == mega['greedy'][:mega['greedy'].index(mega['eos']) + 1] and mega['after_eos'] == []


def test_invalid_sizes(tiny_path, tmp_path):
    from sft_nb.config import ConfigError
    from sft_nb.backends.megatron import MegatronWorker
    from sft_nb.backends.megatron_convert import check_parallel_sizes
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(tiny_path)
    with pytest.raises(ConfigError, match='num_key_value_heads'): check_parallel_sizes(cfg, tp=4)
    with pytest.raises(ConfigError, match='num_hidden_layers'): check_parallel_sizes(cfg, pp=4)
    with pytest.raises(ConfigError, match='must divide world size'): MegatronWorker.dp_index(0, 3, 2, 1)
    with pytest.raises(ConfigError, match='tensor_parallel'):
        SFTTrainer(make_cfg(tiny_path, tmp_path, placement__backend='megatron', placement__workers_per_node=3,
                            placement__tensor_parallel=2), train_data=ROWS)


def _losses(tiny_path, run_dir, rows=ROWS, **kw):
    "Per-step losses, grad norms and the final weights of STEPS steps: 1 rank in this process, more under Ray."
    cfg = make_cfg(tiny_path, run_dir, **kw)
    if cfg['placement'].get('workers_per_node', 1) == 1:
        steps, state = local_run(cfg, rows)
        return [m['loss'] for m in steps], [m['grad_norm'] for m in steps], state
    with SFTTrainer(cfg, train_data=rows) as t:
        h = t.fit()
        return h['loss'].tolist(), h['grad_norm'].tolist(), t.group.call('full_state')[0]


LAYOUTS = {'tp1': dict(placement__workers_per_node=1),
           'dp2': dict(placement__workers_per_node=2),
           'tp2': dict(placement__workers_per_node=2, placement__tensor_parallel=2),
           'pp2': dict(placement__workers_per_node=2, placement__pipeline_parallel=2)}
PACKED = {'packing__enabled': True, 'packing__capacity': 128, 'tokenize__max_length': 64, 'train__global_batch_size': 4, 'train__micro_batch_size': 1}
# every layout on the two ends of the data matrix; the in-process TP=1 on all four
CASES = [(packed, weighted, lay) for packed in (False, True) for weighted in (False, True) for lay in LAYOUTS
         if lay == 'tp1' or packed == weighted]


@pytest.fixture(scope='module')
def fsdp_reference(tiny_path, tmp_path_factory):
    "FSDP's STEPS steps on 1 rank (in this process), once per (packed, weighted)."
    cache = {}
    def get(packed, weighted):
        if (packed, weighted) not in cache:
            cache[packed, weighted] = _losses(tiny_path, tmp_path_factory.mktemp('fsdp'), WROWS if weighted else ROWS, **(PACKED if packed else {}))
        return cache[packed, weighted]
    return get


@pytest.fixture(scope='module')
def megatron_run(tiny_path, tmp_path_factory):
    "Megatron's STEPS steps per (layout, packed, weighted), once: the parity cases and the resume tests' straight runs share them."
    cache = {}
    def get(layout, packed=False, weighted=False):
        if (layout, packed, weighted) not in cache:
            cache[layout, packed, weighted] = _losses(tiny_path, tmp_path_factory.mktemp(f'megatron_{layout}'), WROWS if weighted else ROWS,
                                                      placement__backend='megatron', **LAYOUTS[layout], **(PACKED if packed else {}))
        return cache[layout, packed, weighted]
    return get


@pytest.mark.parametrize('packed,weighted,layout', CASES, ids=[f"{'packed' if p else 'padded'}-{'fractional' if w else '0/1'}-{l}" for p, w, l in CASES])
def test_megatron_matches_fsdp(ray_session, fsdp_reference, megatron_run, packed, weighted, layout):
    "5 steps: Megatron TP=1, DP=2, TP=2 and PP=2 give FSDP's per-step losses, grad norms and final weights (≤1e-4 of their size; weights ≤2e-2 of lr·steps), also with fractional loss weights."
    ref_loss, ref_gn, ref_w = fsdp_reference(packed, weighted)
    loss, gn, w = megatron_run(layout, packed, weighted)
    # loss and grad norm of their magnitude; weights of the distance STEPS Adam updates of ~lr move them
    dl, dg, dw = rel_gap(loss, ref_loss), rel_gap(gn, ref_gn), rel_gap(w, ref_w, scale=1e-3 * STEPS)
    print(f'{"packed" if packed else "padded"}{" weighted" if weighted else ""} {layout}: relative gaps loss {dl:.2e} grad_norm {dg:.2e} weights {dw:.2e} of lr·steps')
    assert len(loss) == STEPS and dl <= 1e-4 and dg <= 1e-4 and dw <= 2e-2, (layout, loss, ref_loss)


@pytest.mark.parametrize('layout', ['tp2', 'dp2_to_dp1'])
def test_megatron_resume_exact(tiny_path, tmp_path, ray_session, megatron_run, layout):
    "5 steps straight (the parity case's run) == 2 steps, save, kill, resume in a new trainer (TP=2 again, or DP=2 → DP=1), 3 more; then export HF."
    straight = 'tp2' if layout == 'tp2' else 'dp2'
    base = dict(placement__backend='megatron', **LAYOUTS[straight])
    after = {**base, 'placement__workers_per_node': 1} if layout == 'dp2_to_dp1' else base
    full, _, w_full = megatron_run(straight)
    t = SFTTrainer(make_cfg(tiny_path, tmp_path / 'half', **base), train_data=ROWS)
    t.fit(2)
    ckpt = t.save()
    t.group.kill(); t.group = None; t.shutdown()
    with SFTTrainer(make_cfg(tiny_path, tmp_path / 'half', checkpoint__resume=str(ckpt), **after), train_data=ROWS) as r:
        assert r.global_step == 2
        resumed = r.fit()['loss'].tolist()
        w = r.group.call('full_state')[0]
        out = r.export()
        msgs = [[{'role': 'user', 'content': 'Who are you?'}]]
        answer = r.generate(msgs, max_new_tokens=6)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation='eager')
    assert all(hf.state_dict()[k].equal(w[k]) for k in w)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(msgs[0], add_generation_prompt=True, tokenize=True, return_tensors='pt', return_dict=True)['input_ids']
    ref = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert answer == [tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()]
    print('resume max|Δloss| =', max(abs(a - b) for a, b in zip(resumed, full)))
    assert resumed[:2] == full[:2]
    # same layout: bit-identical; another DP size sums gradients in another order (float noise only)
    if layout == 'tp2':
        assert resumed == full and all(w[k].equal(w_full[k]) for k in w)
    else:
        assert_rel_close(resumed, full, 4e-6, 'losses'); assert_rel_close(w, w_full, 2e-3, 'weights', scale=1e-3 * STEPS)
