"""`attn_implementation: auto` on a model class without sdpa (Gemma 2) falls back to `eager`, with the additive
form of the packed rows' block mask (made on the worker from the plan's bool mask), never the ValueError transformers
raises for sdpa on such a class. A tiny Gemma 2 (the tiny tokenizer) trains on CPU, and packed == padded on it."""
import numpy as np
import pytest
import torch
from test_moe import rows, layout_cfg


@pytest.fixture(scope='module')
def gemma2_path(tmp_path_factory, tiny_tok):
    from transformers import AutoModelForCausalLM, Gemma2Config
    d = tmp_path_factory.mktemp('gemma2')
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=len(tiny_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=256,
                       pad_token_id=tiny_tok.pad_token_id, bos_token_id=None, eos_token_id=tiny_tok.eos_token_id)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(d); tiny_tok.save_pretrained(d)
    return d


def test_auto_falls_back_to_eager_and_packed_equals_padded(gemma2_path, tiny_tok):
    "One in-process worker: auto resolves to eager; the same 6 sequences padded or packed give the same NLL and gradients; it trains."
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    from sft_nb.collate import collate_padded, collate_packed
    from sft_nb.renderers import tokenize_conversation
    exs = [tokenize_conversation(r, tiny_tok) for r in rows(6)]
    padded = [collate_padded(exs[j:j + 2], tiny_tok.pad_token_id) for j in (0, 2, 4)]
    packed = collate_packed([exs[:3], exs[3:]], tiny_tok.pad_token_id, capacity=max(sum(len(e.input_ids) for e in exs[k:k + 3]) for k in (0, 3)) + 4)
    packed.pop('seq_lens'); packed.pop('cu_seqlens')
    n = sum(mb['n_trained'] for mb in padded)
    res = {}
    for name, mbs in (('padded', padded), ('packed', [packed])):
        w = FSDPWorker(0, 1, ModelConfig(path=str(gemma2_path)), OptimConfig(lr=1e-2, schedule='constant'), total_steps=3)
        info = w.setup()
        assert info['attn_implementation'] == 'eager' and w.model.config._attn_implementation == 'eager'
        r = w.forward_backward(mbs, n)
        res[name] = r['nll_sum'], {k: p.grad.clone() for k, p in w.model.named_parameters()}
        if name == 'packed':  # and it trains: 4 more steps on the same rows lower their loss
            losses = [w.optim_step() and w.forward_backward(mbs, n)['nll_sum'] / n for _ in range(4)]
            assert losses[-1] < r['nll_sum'] / n and all(np.isfinite(losses)), losses
    (a, ga), (b, gb) = res['padded'], res['packed']
    np.testing.assert_allclose(b, a, rtol=1e-5)
    for k in ga: torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-7, msg=k)


def test_gemma2_trains_packed_and_padded(gemma2_path, tmp_path, ray_session):
    "The trainer (1 Ray worker, auto attention) runs 3 steps of the tiny Gemma 2 on the same rows padded and packed, with equal losses and gradient norms."
    from sft_nb.trainer import SFTTrainer
    runs = {}
    for name, packing in (('padded', False), ('packed', True)):
        with SFTTrainer(layout_cfg(gemma2_path, tmp_path / name, packing)) as t:
            runs[name] = t.fit()
            assert t.model_info['attn_implementation'] == 'eager'
    a, b = runs['padded'], runs['packed']
    print(a[['loss', 'grad_norm']], b[['loss', 'grad_norm']])
    np.testing.assert_allclose(b['loss'], a['loss'], rtol=1e-4)
    np.testing.assert_allclose(b['grad_norm'], a['grad_norm'], rtol=1e-3)
    assert np.isfinite(a['loss']).all() and (a['grad_norm'] > 0).all()  # random-id rows: nothing to learn in 3 steps (see the test above)
