"""CUDA kernels of the chunked loss and of FlexAttention: same values and gradients as the reference paths."""
import os
import pytest
import torch
# SFT_NB_GPU_TESTS_ON_CPU=1 runs what can run on CPU (fp32, gloo) to check the tests themselves; not a GPU result
ON_CPU = os.environ.get('SFT_NB_GPU_TESTS_ON_CPU') == '1' and not torch.cuda.is_available()
if not torch.cuda.is_available() and not ON_CPU: pytest.skip('needs CUDA', allow_module_level=True)
needs_cuda = pytest.mark.skipif(ON_CPU, reason='needs CUDA (CPU smoke run)')
import torch.nn.functional as F
from sft_nb.numerics import assert_rel_close, rel_gap
from sft_nb.loss import linear_nll, attention_inputs, document_block_mask
from sft_nb.collate import collate_packed, model_inputs

DEV = 'cpu' if ON_CPU else 'cuda'


@pytest.fixture(autouse=True)
def no_tf32():  # fp32 matmuls stay fp32 (TF32 would round to 10-bit mantissas)
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize('weighted', [False, True])
def test_chunked_ce_exact_fp32_cuda(weighted):
    "fp32 on CUDA, 1,000 tokens in chunks of 96 (not a multiple), SmolLM2's head shape: Σ NLL ≤ 1e-6 relative, gradients of the mean ≤ 2e-6 of each one's magnitude."
    torch.manual_seed(0)
    h, W = torch.randn(1000, 576, device=DEV) * .5, torch.randn(49152, 576, device=DEV) * .05
    t = torch.randint(0, 49152, (1000,), device=DEV)
    w = torch.rand(1000, device=DEV) * 2 if weighted else None
    def run(fn):
        xs = [x.clone().requires_grad_() for x in (h, W)]
        loss = fn(*xs); (loss / len(t)).backward()  # the gradient of the mean, the scale training uses
        return float(loss), [x.grad for x in xs]
    def ref(h, W):
        nll = F.cross_entropy(h @ W.T, t, reduction='none')
        return nll.sum() if w is None else (nll * w).sum()
    l0, g0 = run(ref)
    l1, g1 = run(lambda h, W: linear_nll(h, W, t, w, chunk=96))
    assert abs(l1 - l0) <= 1e-6 * abs(l0)
    assert_rel_close(g1, g0, 2e-6, 'gradients of h, W')


@needs_cuda
def test_chunked_ce_bf16_cuda_and_memory():
    """bf16 head (FSDP2 mixed precision): the chunked loss equals `cross_entropy(head(h).float())` within bf16 rounding, and its
    peak CUDA memory for 16,384 tokens × 49,152 vocab is far below the one-shot loss's (3 GiB of fp32 logits)."""
    torch.manual_seed(0)
    N, H, V = 16384, 576, 49152
    h = (torch.randn(N, H, device=DEV) * .5).bfloat16()
    W = (torch.randn(V, H, device=DEV) * .05).bfloat16()
    t = torch.randint(0, V, (N,), device=DEV)
    peaks, res = {}, {}
    for name, fn in (('one-shot', lambda h, W: F.cross_entropy((h @ W.T).float(), t, reduction='sum')),
                     ('chunked', lambda h, W: linear_nll(h, W, t, chunk=2048))):
        xs = [x.clone().requires_grad_() for x in (h, W)]
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        loss = fn(*xs); loss.backward(); torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        res[name] = (float(loss), [x.grad.float() for x in xs])
    print(f"peak CUDA memory above inputs: {peaks}")
    (l0, g0), (l1, g1) = res['one-shot'], res['chunked']
    assert abs(l1 - l0) <= 1e-3 * abs(l0)
    for a, c in zip(g0, g1): assert float((a - c).abs().max()) <= 2e-2 * float(a.abs().max())
    assert peaks['chunked'] < 0.5 * peaks['one-shot']


def _packed_batch():
    torch.manual_seed(0)
    rows = [[{'input_ids': torch.randint(5, 700, (n,)).tolist(), 'loss_mask': [0] * 2 + [1] * (n - 2)} for n in lens]
            for lens in ([100, 140, 37], [200, 77])]
    return collate_packed(rows, 0, capacity=300)


def test_document_block_mask_compiled_matches_dense():
    mb = _packed_batch()
    bm = document_block_mask(mb['position_ids'].to(DEV))  # compiled on CUDA: no dense mask is built
    from torch.nn.attention.flex_attention import create_mask
    dense = create_mask(bm.mask_mod, 2, 1, 300, 300, device=DEV)
    assert torch.equal(dense.cpu(), mb['attention_mask'])  # the collator's block-diagonal causal mask, padding sees itself


@needs_cuda
def test_flex_attention_backward_matches_sdpa(tiny_path):
    "Tiny model on CUDA, packed rows: flex_attention + document BlockMask vs sdpa + dense mask, loss and every gradient (fp32)."
    from transformers import AutoModelForCausalLM
    from sft_nb.loss import token_nll_sum
    mb = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in _packed_batch().items()}
    out = {}
    for impl in ('sdpa', 'flex_attention'):
        model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation=impl).to(DEV)
        s, n = token_nll_sum(model(**model_inputs(attention_inputs(mb, impl))).logits, mb['labels'])
        (s / n).backward()
        out[impl] = float(s / n), {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    (l0, g0), (l1, g1) = out['sdpa'], out['flex_attention']
    d = rel_gap(g1, g0)
    print(f"flex vs sdpa: |Δloss| {abs(l1 - l0):.2e}, gradients {d:.2e} of their size")
    assert abs(l1 - l0) <= 1e-5 * abs(l0) and d <= 1e-4
