"""Sharded loading (`model.load: slices`): every rank builds on `meta` and reads only its own rows of each tensor from the
safetensors files. Real 2-process gloo groups: the first 5 steps' losses and the weights after them equal those of every
rank reading the whole checkpoint (`load: every_rank`, the same FSDP layout: bitwise) for tied, untied, LoRA, MoE and bf16-saved
models and the VLM; tied embeddings stay tied, nothing stays on `meta`."""
import os, queue, time
import pytest
import torch
import torch.multiprocessing as mp
from helpers import run_cfg

STEPS = 5


def rows(n=8):
    return [[{'role': 'user', 'content': f'What is {i} plus {i}?'}, {'role': 'assistant', 'content': f'It is {2 * i}, I think.'}]
            for i in range(n)]


def _rank(rank, world, port, cases, out):
    "One rank: for each (name, model config) build a worker, train STEPS steps on the same 2 micro-batches per rank, record losses and gradient norms."
    from transformers import AutoTokenizer
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import OptimConfig
    from sft_nb.collate import collate_padded
    from sft_nb.renderers import tokenize_conversation
    res = {}
    w0 = None
    for name, mcfg in cases:
        w = FSDPWorker(rank, world, mcfg, OptimConfig(lr=1e-2, schedule='constant'), total_steps=STEPS)
        if w0 is None: w.init_dist('127.0.0.1', port); w0 = w
        w.setup()
        tok = AutoTokenizer.from_pretrained(w.path)
        exs = [tokenize_conversation(r, tok) for r in rows()]
        mbs = [collate_padded(exs[j:j + 2], tok.pad_token_id) for j in range(0, 8, 2)]
        n_global = sum(int(mb['n_trained']) for mb in mbs)
        mine = mbs[rank::world]
        emb, head = w.model.get_input_embeddings(), w.model.get_output_embeddings()
        info = {'tied': head.weight is emb.weight,
                'meta': [n for n, t in [*w.model.named_parameters(), *w.model.named_buffers()] if t.device.type == 'meta'],
                'inv_freq': {n: b.dtype for n, b in w.model.named_buffers() if n.endswith('inv_freq')},
                'inv_freq_ok': all(torch.isfinite(b).all() and b.max() <= 1 and b.min() > 0 for n, b in w.model.named_buffers() if n.endswith('inv_freq'))}
        losses, norms = [], []
        for _ in range(STEPS):
            r = w.forward_backward(mine, n_global)
            losses.append(w.all_reduce_sum(r['nll_sum']) / n_global)
            norms.append(w.optim_step()['grad_norm'])
        info['losses'], info['grad_norms'] = losses, norms
        state = w.full_state()  # a collective: every rank takes part
        info['state'] = {k: v.numpy().copy() for k, v in state.items()} if rank == 0 else None  # plain pickles, not shared tensors
        res[name] = info
        del w.model, w.opt
    out.put((rank, {k: {**v, 'state': None} if rank else v for k, v in res.items()}))
    import torch.distributed as dist
    dist.destroy_process_group()


def run_ranks(cases, world=2):
    from sft_nb.workers import free_port
    ctx = mp.get_context('spawn')
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, cases, q)) for r in range(world)]
    for p in procs: p.start()
    got, deadline = {}, time.monotonic() + 600
    while len(got) < len(procs):  # a rank that dies fails the test now, not when the other one's collective times out
        try: got.update([q.get(timeout=1)])
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs: p.kill()
                raise AssertionError(f'a rank failed or hung: exit codes {[p.exitcode for p in procs]}') from None
    for p in procs: p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got


@pytest.fixture(scope='module')
def untied_path(tmp_path_factory, tiny_path):
    "The tiny model with its LM head untied from the embeddings (own random head)."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = tmp_path_factory.mktemp('untied')
    m = AutoModelForCausalLM.from_pretrained(tiny_path)
    m.config.tie_word_embeddings = False
    m2 = AutoModelForCausalLM.from_config(m.config)
    sd = m.state_dict(); sd['lm_head.weight'] = torch.randn_like(sd['lm_head.weight']) * 0.02
    m2.load_state_dict(sd)
    m2.save_pretrained(d); AutoTokenizer.from_pretrained(tiny_path).save_pretrained(d)
    return d


@pytest.fixture(scope='module')
def moe_path(tmp_path_factory, tiny_tok):
    "The tiny Qwen3-MoE of tests/test_moe.py (4 experts: each of 2 ranks reads 2 of them), saved as transformers saves it (one tensor per expert)."
    from transformers import AutoModelForCausalLM
    from test_moe import moe_config
    d = tmp_path_factory.mktemp('moe')
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(len(tiny_tok)), dtype=torch.float32).save_pretrained(d); tiny_tok.save_pretrained(d)
    return d


@pytest.fixture(scope='module')
def bf16_path(tmp_path_factory, untied_path):
    "The untied tiny model saved in bfloat16, as most hub checkpoints are (2 bytes a value: each rank's rows start elsewhere than in F32)."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from sft_nb.backends.slices import checkpoint_files, safetensors_header
    d = tmp_path_factory.mktemp('bf16')
    AutoModelForCausalLM.from_pretrained(untied_path, dtype=torch.bfloat16).save_pretrained(d)
    AutoTokenizer.from_pretrained(untied_path).save_pretrained(d)
    heads = [safetensors_header(f)[0] for f in set(checkpoint_files(d).values())]
    assert {e['dtype'] for h in heads for k, e in h.items() if k != '__metadata__'} == {'BF16'}
    return d


def test_sharded_load_equals_every_rank_load(tiny_path, untied_path, moe_path, bf16_path):
    """Tied, untied, LoRA, MoE and bf16-checkpoint tiny models on 2 gloo ranks: slice-load losses and weights == every-rank-load
    ones bitwise (a bf16 checkpoint: its values widened to float32 as `from_pretrained` widens them), tying and rotary buffers intact."""
    from sft_nb.config import ModelConfig
    cases, names = [], ('tied', 'untied', 'lora', 'moe', 'bf16')
    for name, kw in (('tied', dict(path=str(tiny_path))), ('untied', dict(path=str(untied_path))),
                     ('lora', dict(path=str(tiny_path), lora_r=4)), ('moe', dict(path=str(moe_path))), ('bf16', dict(path=str(bf16_path)))):
        for load in ('every_rank', 'slices'): cases.append((f'{name}-{load}', ModelConfig(load=load, **kw)))
    got = run_ranks(cases)
    for name in names:
        old, new = got[0][f'{name}-every_rank'], got[0][f'{name}-slices']
        print(name, new['losses'])
        assert new['losses'] == old['losses'], (name, old['losses'], new['losses'])
        assert new['losses'][-1] < new['losses'][0]
        for k, v in old['state'].items(): assert (new['state'][k] == v).all(), (name, k)
        for r in (0, 1):
            info = got[r][f'{name}-slices']
            assert info['tied'] == (name not in ('untied', 'bf16')) and info['meta'] == [] and info['inv_freq_ok'], (name, r, info)
            assert set(info['inv_freq'].values()) == {torch.float32}
            assert got[r][f'{name}-slices']['losses'] == new['losses']  # every rank saw the same global loss
    assert got[0]['lora-slices']['state'].keys() == got[0]['lora-every_rank']['state'].keys()
    assert any('lora_A' in k for k in got[0]['lora-slices']['state'])


def test_sharded_load_vlm(shared, tmp_path, ray_session):
    "The tiny VLM on 2 Ray FSDP workers: slice-load losses of 5 mixed image/text steps and the weights after them == every-rank-load ones."
    from test_vlm import vlm_cfg
    from sft_nb.trainer import SFTTrainer
    runs, states = {}, {}
    for load in ('every_rank', 'slices'):
        with SFTTrainer(vlm_cfg(shared, tmp_path / load, train__num_steps=STEPS, train__micro_batch_size=2,
                                placement__workers_per_node=2, model__load=load)) as t:
            runs[load] = t.fit()['loss'].tolist()
            states[load] = t.backend.full_state()[0]  # the trained weights, gathered
    print(runs)
    assert states['slices'].keys() == states['every_rank'].keys()
    assert [k for k, v in states['every_rank'].items() if not torch.equal(states['slices'][k], v)] == []  # every tensor, bitwise
    assert runs['slices'] == runs['every_rank'], runs
