"""MoE: a tiny Qwen3-MoE (4 experts, top 2, < 1M parameters) whose config asks for the router load-balancing loss
(`output_router_logits`, `router_aux_loss_coef`). The worker adds coef · (mean per-sequence Switch loss over the global
batch's sequences) to the objective, with its own divisor (never the trained-token count), and the step metrics report it
as `aux_loss` apart from the NLL `loss`. Checked: the gradient is that of NLL / n_trained + coef · aux / n_seqs computed by
hand from the model's own forward; packed rows give the same losses, aux losses and gradient norms as padded ones (padding
and packed fill never enter the aux loss); 2 ranks equal 1 rank; the trainer logs it; megatron refuses MoE models."""
import json
import numpy as np
import pytest
import torch
from helpers import run_cfg

COEF = 0.05


def moe_config(vocab_size: int, **kw):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512,
                          output_router_logits=True, router_aux_loss_coef=COEF, tie_word_embeddings=True, **kw)


@pytest.fixture(scope='module')
def moe_path(tmp_path_factory, tiny_path, tiny_tok):
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp('moe')
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(moe_config(len(tiny_tok)), dtype=torch.float32)
    assert sum(p.numel() for p in m.parameters()) < 1_000_000
    m.save_pretrained(d); tiny_tok.save_pretrained(d)
    return d


def rows(n=8):
    return [[{'role': 'user', 'content': f'What is {i} plus {i}? ' * (1 + i % 3)}, {'role': 'assistant', 'content': f'It is {2 * i}.'}]
            for i in range(n)]


def _worker(path, **mkw):
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    w = FSDPWorker(0, 1, ModelConfig(path=str(path), **mkw), OptimConfig(lr=1e-2, schedule='constant'), total_steps=3)
    return w, w.setup()


def test_aux_loss_gradient_is_nll_plus_coef_times_sequence_mean(moe_path, tiny_tok):
    "One worker, two padded micro-batches: the gradient equals that of Σ NLL / n_trained + coef · Σ_s aux_s / n_seqs by hand."
    from transformers import AutoModelForCausalLM
    from sft_nb.collate import collate_padded
    from sft_nb.renderers import tokenize_conversation
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    w, info = _worker(moe_path)
    assert info['router_aux_coef'] == COEF and not w.model.config.output_router_logits
    exs = [tokenize_conversation(r, tiny_tok) for r in rows(4)]
    mbs = [collate_padded(exs[j:j + 2], tiny_tok.pad_token_id) for j in (0, 2)]
    n = sum(mb['n_trained'] for mb in mbs)
    r = w.forward_backward(mbs, n)
    assert r['n_seqs'] == 4
    got = {k: p.grad.clone() for k, p in w.model.named_parameters()}
    ref = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    nll = sum(torch.nn.functional.cross_entropy(ref(input_ids=torch.tensor([e.input_ids])).logits[0, :-1],
                                                torch.tensor([e.input_ids[1:]]).masked_fill(torch.tensor([e.loss_mask[1:]]) == 0, -100)[0],
                                                reduction='sum') for e in exs)
    aux = [load_balancing_loss_func(ref(input_ids=torch.tensor([e.input_ids])).router_logits, 4, 2) for e in exs]  # each sequence alone
    (nll / n + COEF * sum(aux) / 4).backward(retain_graph=True)
    np.testing.assert_allclose(r['aux_sum'], float(sum(aux)), rtol=1e-5)
    np.testing.assert_allclose(r['nll_sum'], float(nll), rtol=1e-5)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-7, msg=k)
    gate = next(k for k in got if 'mlp.gate' in k)
    ref.zero_grad(); (nll / n).backward()  # the router's gradient without the aux loss differs: it is in the objective
    assert (got[gate] - ref.get_parameter(gate).grad).abs().max() > 1e-3 * got[gate].abs().max()


def test_packed_equals_padded_on_the_aux_loss(moe_path, tiny_tok):
    "The same 6 sequences, padded in 3 micro-batches of 2 or packed in 2 rows with padding at the end: same NLL, aux sum, n_seqs and gradients."
    from sft_nb.collate import collate_padded, collate_packed
    from sft_nb.renderers import tokenize_conversation
    exs = [tokenize_conversation(r, tiny_tok) for r in rows(6)]
    padded = [collate_padded(exs[j:j + 2], tiny_tok.pad_token_id) for j in (0, 2, 4)]
    cap = max(sum(len(e.input_ids) for e in exs[:3]), sum(len(e.input_ids) for e in exs[3:])) + 5  # fill at the end of each row
    packed = [collate_packed([exs[:3], exs[3:]], tiny_tok.pad_token_id, capacity=cap)]
    packed[0].pop('seq_lens'); packed[0].pop('cu_seqlens')
    n = sum(mb['n_trained'] for mb in padded)
    assert n == packed[0]['n_trained']
    res = {}
    for name, mbs in (('padded', padded), ('packed', packed)):
        w, _ = _worker(moe_path)
        r = w.forward_backward(mbs, n)
        res[name] = r, {k: p.grad.clone() for k, p in w.model.named_parameters()}
    (a, ga), (b, gb) = res['padded'], res['packed']
    print(a, b)
    assert a['n_seqs'] == b['n_seqs'] == 6
    np.testing.assert_allclose(b['aux_sum'], a['aux_sum'], rtol=1e-5)
    np.testing.assert_allclose(b['nll_sum'], a['nll_sum'], rtol=1e-5)
    for k in ga: torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-7, msg=k)


def layout_cfg(path, run_dir, packing: bool, workers: int = 1) -> dict:
    """3 steps on the same rows padded or packed: 24 synthetic rows of 32 tokens in data order, two to a packed row of 64
    (greedy packing keeps them in order), so step k trains rows 8k..8k+7 in both layouts."""
    return run_cfg(path, run_dir, data__synthetic_rows=24, tokenize__max_length=32, train__sampler='sequential', train__num_steps=3,
                   train__global_batch_size=4 if packing else 8, train__micro_batch_size=1 if packing else 2,
                   packing__enabled=packing, packing__strategy='greedy', packing__capacity=64, placement__workers_per_node=workers)


def test_trainer_logs_aux_loss_packed_equals_padded(moe_path, tmp_path, ray_session):
    "The trainer on 2 Ray workers: 3 steps padded and 3 packed; `aux_loss` logged apart from `loss` (in metrics.jsonl too), both equal across layouts, and it trains."
    from sft_nb.trainer import SFTTrainer
    runs = {}
    for name, packing in (('padded', False), ('packed', True)):
        with SFTTrainer(layout_cfg(moe_path, tmp_path / name, packing, workers=2)) as t:
            runs[name] = t.fit()
            assert t.model_info['router_aux_coef'] == COEF
            if packing: assert [len(b) for b in t.data.items] == [2] * 12
        logged = [json.loads(l) for l in (tmp_path / name / 'metrics.jsonl').read_text().splitlines()]
        assert all('aux_loss' in m and 'loss' in m for m in logged if 'grad_norm' in m), logged
    a, b = runs['padded'], runs['packed']
    print(a[['loss', 'aux_loss', 'grad_norm']], b[['loss', 'aux_loss', 'grad_norm']])
    assert (a['aux_loss'] > 0.9).all() and (a['aux_loss'] != a['loss']).all()  # E·Σ f·P ≥ 1 per sequence; not the NLL
    np.testing.assert_allclose(b['aux_loss'], a['aux_loss'], rtol=1e-4)
    np.testing.assert_allclose(b['loss'], a['loss'], rtol=1e-4)
    np.testing.assert_allclose(b['grad_norm'], a['grad_norm'], rtol=1e-3)
    assert a['loss'].iloc[-1] < a['loss'].iloc[0]


def test_megatron_refuses_moe(moe_path):
    from transformers import AutoConfig
    from sft_nb.backends.megatron import transformer_config
    from sft_nb.config import ConfigError
    with pytest.raises(ConfigError, match='mixture-of-experts model; the megatron backend builds dense models only'):
        transformer_config(AutoConfig.from_pretrained(moe_path))
