"""A quantized base (model.quantize nf4/int8, QLoRA) and the LoRA variants on the tiny model, one in-process FSDP worker:
nf4 + LoRA trains, its loss equals the same LoRA on the dequantized base, a checkpoint resumes exactly (LoRA+'s two groups
too), the merged export is the source weights + B@A·scale, DoRA's magnitudes read in slices are the loaded weights' norms,
and every combination it cannot run is refused by name."""
import pytest
import torch
from sft_nb.config import ModelConfig, OptimConfig, ConfigError, load_config
from sft_nb.collate import collate_padded
from sft_nb.demo_data import identity_rows

# nf4 on CPU dequantizes each weight and runs an fp32 matmul: against the dequantized base only the sums' order differs
TOL = 1e-5


@pytest.fixture(scope='module')
def group():
    "One 1-rank gloo group for the module's workers (each unsharded worker needs none; slices loading shards)."
    import torch.distributed as dist
    from sft_nb.workers import free_port
    from sft_nb.backends.fsdp import FSDPWorker
    w = FSDPWorker(0, 1, ModelConfig(), OptimConfig(), total_steps=1)
    w.init_dist('127.0.0.1', free_port())
    yield
    if dist.is_initialized(): dist.destroy_process_group()


@pytest.fixture(scope='module')
def mb(tiny_tok):
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(identity_rows()['train'][:4], tiny_tok, TokenizeConfig(max_length=64))
    return collate_padded([dict(r) for r in ds], tiny_tok.pad_token_id)


def worker(tiny_path, steps=4, optim=None, **model):
    from sft_nb.backends.fsdp import FSDPWorker
    mcfg = ModelConfig(path=str(tiny_path), **({'quantize': 'nf4', 'lora_r': 8, 'lora_target_modules': ['all-linear']} | model))
    w = FSDPWorker(0, 1, mcfg, optim or OptimConfig(lr=2e-3, schedule='constant'), total_steps=steps)
    w.setup()
    return w


def step(w, mb) -> float:
    fb = w.forward_backward([mb], mb['n_trained'])
    w.optim_step()
    return fb['nll_sum'] / fb['weight_sum']


def test_nf4_lora_trains(tiny_path, group, mb):
    "nf4 + LoRA on all linears: the linears are 4-bit, the head and norms fp32, only the adapters train; the loss falls."
    import bitsandbytes as bnb
    w = worker(tiny_path)
    lin = w.model.base_model.model.model.layers[0].mlp.up_proj
    assert isinstance(lin.base_layer, bnb.nn.Linear4bit) and lin.base_layer.weight.quant_state.quant_type == 'nf4'
    assert w.model.base_model.model.lm_head.weight.dtype == torch.float32
    assert all('lora_' in n for n, p in w.model.named_parameters() if p.requires_grad)
    losses = [step(w, mb) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_nf4_equals_lora_on_dequantized_base(tiny_path, group, mb):
    """One step's loss and adapter gradients equal those of the same LoRA on a float model whose linears hold the
    dequantized nf4 weights; an eval forward (which bitsandbytes would repack for its bf16 CPU kernel) gives the same loss."""
    import bitsandbytes.functional as F
    from bitsandbytes.nn import Linear4bit
    q = worker(tiny_path)
    deq = {n.replace('.base_layer', ''): F.dequantize_4bit(m.weight.data, m.weight.quant_state)
           for n, m in q.model.named_modules() if isinstance(m, Linear4bit)}
    f = worker(tiny_path, quantize='none')
    with torch.no_grad():
        for n, m in f.model.named_modules():
            if n.endswith('.base_layer') and n.replace('.base_layer', '') in deq: m.weight.copy_(deq[n.replace('.base_layer', '')])
        f.model.load_state_dict({k: v for k, v in q.model.state_dict().items() if '.lora_' in k}, strict=False)
    assert len(deq) == 14
    ev = q.eval_loss([mb])['nll_sum']
    got = [w.forward_backward([mb], mb['n_trained'])['nll_sum'] for w in (q, f)]
    assert abs(got[0] - got[1]) <= TOL * abs(got[1]), got
    assert abs(ev - got[0]) <= TOL * abs(got[0]), (ev, got[0])
    gq, gf = ({n: p.grad for n, p in w.model.named_parameters() if p.requires_grad} for w in (q, f))
    assert gq.keys() == gf.keys()
    for k in gq: torch.testing.assert_close(gq[k], gf[k], rtol=1e-4, atol=1e-6)


def test_nf4_resume_is_exact_with_lora_plus(tiny_path, group, mb, tmp_path):
    """A checkpoint of an nf4 run holds the adapters and their Adam state, not the base; a worker that loads it goes on
    with the same losses; LoRA+'s B group keeps its LR ratio."""
    from sft_nb.checkpoint import read_dcp_metadata
    opt = OptimConfig(lr=2e-3, schedule='linear', lora_plus_ratio=16)
    a = worker(tiny_path, optim=opt)
    assert [g['lr_ratio'] for g in a.opt.param_groups] == [1.0, 16.0]
    assert all('.lora_B.' in n for n, p in a.model.named_parameters() if any(p is x for x in a.opt.param_groups[1]['params']))
    step(a, mb); a.save(str(tmp_path))
    keys = [k for k in read_dcp_metadata(tmp_path).state_dict_metadata if k.startswith('model.')]
    assert keys and all('.lora_' in k for k in keys), keys[:3]
    want = [step(a, mb), step(a, mb)]
    b = worker(tiny_path, optim=opt)
    assert b.load(str(tmp_path)) == 1
    assert [step(b, mb), step(b, mb)] == want
    assert [g['lr'] for g in b.opt.param_groups] == [g['lr'] for g in a.opt.param_groups]


def test_nf4_merged_export_is_source_plus_adapter(tiny_path, group, mb, capsys):
    """The merged export of an nf4 run is the source checkpoint's original weights + B @ A · scale (exactly: the same
    fp32 operations), not the dequantized 4-bit ones; it says so."""
    from safetensors.torch import load_file
    w = worker(tiny_path, lora_rslora=True)
    step(w, mb)
    state = w.full_state()
    hf = w.hf_model(state)
    assert 'original weights' in capsys.readouterr().err
    src = load_file(str(tiny_path / 'model.safetensors'))
    scale = 16 / 8 ** 0.5  # rsLoRA: alpha / sqrt(r)
    got = hf.state_dict()
    n = 0
    for k, W in src.items():
        pre = 'base_model.model.' + k.removesuffix('.weight')
        if f'{pre}.lora_A.default.weight' not in state:
            torch.testing.assert_close(got[k], W, rtol=0, atol=0); continue
        A, B = state[f'{pre}.lora_A.default.weight'], state[f'{pre}.lora_B.default.weight']
        assert torch.equal(got[k], W + (B @ A) * scale), k
        n += 1
    assert n == 14


def test_dora_magnitudes_read_in_slices(tiny_path, group):
    "DoRA under model.load: slices: each magnitude is its loaded weight's row norm, as PEFT computes it on a whole load."
    from sft_nb.backends.fsdp import FSDPWorker
    mcfg = ModelConfig(path=str(tiny_path), lora_r=4, lora_dora=True)
    v = FSDPWorker(0, 1, mcfg, OptimConfig(), total_steps=1); v.path, v.attn = str(tiny_path), 'sdpa'
    sliced, whole = v._load_sharded(torch.float32), v._build_model('cpu')
    mags = {n: p for n, p in whole.named_parameters() if 'lora_magnitude_vector' in n}
    got = {n: p.full_tensor() for n, p in sliced.named_parameters() if 'lora_magnitude_vector' in n}
    assert len(mags) == 8 and got.keys() == mags.keys()
    for k in mags: torch.testing.assert_close(got[k], mags[k].detach())


def test_refused_combinations(tiny_path):
    "What cannot run is refused by name, with the fix."
    from fastcore.test import test_fail
    from sft_nb.backends.fsdp import FSDPWorker
    two = FSDPWorker(0, 2, ModelConfig(path=str(tiny_path), quantize='nf4', lora_r=8), OptimConfig(), total_steps=1)
    test_fail(lambda: two.build(torch.float32), contains="model.load: every_rank")
    int8 = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path), quantize='int8', lora_r=8), OptimConfig(), total_steps=1)
    test_fail(lambda: int8.build(torch.float32), contains="use model.quantize: nf4")
    test_fail(lambda: load_config({'optim': {'lora_plus_ratio': 16}}), contains="optim.lora_plus_ratio: 16")
    test_fail(lambda: ModelConfig(quantize='nf4'), contains="set lora_r")


def test_megatron_refuses_quantize(tiny_path):
    "The megatron backend refuses a quantized base, naming the fsdp backend."
    pytest.importorskip('megatron.core')
    from fastcore.test import test_fail
    from sft_nb.backends.megatron import MegatronWorker
    w = MegatronWorker(0, 1, ModelConfig(path=str(tiny_path), quantize='nf4', lora_r=8), OptimConfig(), total_steps=1)
    test_fail(w.setup, contains="placement.backend: fsdp")
