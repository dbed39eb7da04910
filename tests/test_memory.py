"""Memory options of the model config (activation checkpointing full/selective, reshard_after_forward): each trains 5
steps on 2 gloo ranks with the same losses and gradient norms as without it (fp32, relative bounds), and leaves the
same weights. cpu_offload (FSDP2 CPUOffloadPolicy) needs an accelerator: on CPU workers it is refused by name (no GPU
here to run its parity test)."""
import numpy as np
from test_sharded_load import run_ranks

OPTIONS = {'ac_full': dict(activation_checkpointing='full'), 'ac_selective': dict(activation_checkpointing='selective'),
           'keep_gathered': dict(reshard_after_forward=False)}


def test_memory_options_keep_losses_and_gradients(tiny_path):
    from sft_nb.config import ModelConfig
    cases = [('plain', ModelConfig(path=str(tiny_path)))]
    cases += [(k, ModelConfig(path=str(tiny_path), **kw)) for k, kw in OPTIONS.items()]
    got = run_ranks(cases)[0]
    ref = got['plain']
    for k in OPTIONS:
        print(k, got[k]['losses'], got[k]['grad_norms'])
        np.testing.assert_allclose(got[k]['losses'], ref['losses'], rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(got[k]['grad_norms'], ref['grad_norms'], rtol=1e-4, err_msg=k)
        for n, v in ref['state'].items(): np.testing.assert_allclose(got[k]['state'][n], v, rtol=1e-4, atol=1e-6, err_msg=f'{k} {n}')
    assert ref['losses'][-1] < ref['losses'][0]


ESTIMATES = {  # name: sft-nb estimate's arguments after examples/tiny.yaml
    'rows_of_2e8_tokens': ['tokenize.max_length=200000000', 'tokenize.extend_context=true', '--no-data'],
    'micro_batch_of_50000': ['train.micro_batch_size=50000', 'train.global_batch_size=50000', '--no-data'],
    'ranks_100000': ['--gpus', '100000'],
    'sp2_on_2_gpus_of_1_mib': ['placement.sequence_parallel=2', '--gpus', '2', '--gpu-memory', '0.001'],
}


def test_estimate_answers_any_shape_within_2_gib_and_agrees_with_itself(tmp_path):
    """sft-nb estimate, in one subprocess whose peak RSS (its own getrusage) stays within 2 GiB: rows of 2e8 tokens and a
    micro-batch of 50,000 rows are refused by key, past the tokens a rank it traces (their batch is fake: nothing of
    their size is allocated); 100,000 ranks are refused past the ranks it answers; sequence_parallel is checked against
    the --gpus estimated for, and where not even the weights fit the data line says no row length does (not that all
    rows fit)."""
    import json, os, resource, subprocess, sys
    from pathlib import Path
    code = ("import json, sys; sys.path.insert(0, 'tests'); from helpers import cli; "
            f"cases = {ESTIMATES!r}; got = {{k: cli('estimate', 'examples/tiny.yaml', *a, "
            "*([] if '--gpus' in a else ['--gpus', '1']), *([] if '--gpu-memory' in a else ['--gpu-memory', '80'])) "
            "for k, a in cases.items()}; import resource; "
            "print(json.dumps(got | {'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")
    root = Path(__file__).resolve().parent.parent
    # a cap on the heap, so that a regression fails here instead of taking the machine's memory
    cap = lambda: resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, 3 * 2**30))
    out = subprocess.run([sys.executable, '-c', code], cwd=root, capture_output=True, text=True, preexec_fn=cap,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1]); peak = got['peak']
    assert peak <= 2 * 2**30, f'{peak / 2**30:.2f} GiB'
    rc, _, err = got['rows_of_2e8_tokens']
    assert rc == 2 and 'a micro-batch of 4 rows of 200,000,000 tokens is 800,000,000 tokens a rank' in err, err
    rc, _, err = got['micro_batch_of_50000']
    assert rc == 2 and 'a micro-batch of 50,000 rows of 2,048 tokens' in err and 'lower train.micro_batch_size' in err, err
    rc, _, err = got['ranks_100000']
    assert rc == 2 and 'gpus x nodes: 100,000 ranks; the estimate answers up to 8,192' in err, err
    rc, txt, err = got['sp2_on_2_gpus_of_1_mib']
    assert rc == 3 and txt.startswith('2 ranks (cuda)') and 'does not fit' in txt, (txt, err)
    assert 'no row length does' in txt and 'longer than one worker holds' not in txt, txt


def test_estimate_fit_prints_the_lever_table_cheapest_first():
    """`sft-nb estimate CONFIG --gpu-memory G --fit` (in this process: a fake process group per trace, none left behind):
    the verdict, then one line per combination shown with its levers, peak and longest row, the config's own marked, the
    dearer ones below; exit 0 when one fits."""
    from helpers import cli
    rc, out, err = cli('estimate', 'examples/tiny.yaml', 'model.lora_r=8', 'model.tiled_mlp=32', 'tokenize.max_length=64',
                       'train.micro_batch_size=2', '--gpu-memory', '0.05', '--fit')
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0].startswith('30 of 30 lever combinations fit rows of 64 tokens (2 a micro-batch) on 1 rank (cuda) of '
                               '0.05 GiB; the cheapest: '), out
    assert lines[1].split() == ['checkpointing', 'tiled_mlp', 'act_offload', 'cpu_offload', 'quantize', 'peak', 'GiB',
                                'longest', 'row'], out
    rows = [l for l in lines[2:] if l[:1] in ('>', ' ') and 'GiB' not in l and 'positions' not in l]
    assert rows[0].split()[:5] == ['none', '-', 'no', 'no', 'none'] and any(l.startswith('>') for l in rows), out
    assert any('nf4 (QLoRA)' in l for l in rows) and rows.index(next(l for l in rows if 'nf4' in l)) > 0, out
    assert lines[-1].startswith('fitted in '), out


def test_estimate_fit_refuses_a_missing_gpu_memory_by_name():
    "--fit on GPUs needs --gpu-memory, and --no-data is no --fit option: each refused by name (exit 2), before any trace."
    from helpers import cli
    rc, out, err = cli('estimate', 'examples/tiny.yaml', '--fit')
    assert rc == 2 and 'sft-nb estimate: error: --fit: needs --gpu-memory, the GiB of one GPU the levers must fit in' in err, err
    rc, out, err = cli('estimate', 'examples/tiny.yaml', '--fit', '--gpu-memory', '24', '--no-data')
    assert rc == 2 and '--fit, --no-data: --fit steps on rows of tokenize.max_length already' in err, err


def test_estimate_counts_the_loss_logsumexp_temporary(tmp_path):
    """The estimate's peak holds, beside the loss's chunk of fp32 logits, the temporary of their size ATen's logsumexp
    makes inside itself (`LogsumexpTemp`): with LoRA and full checkpointing on the tiny model with a 32k vocabulary, that
    moment sets the peak (a fake step; config.json alone)."""
    import json
    from pathlib import Path
    from sft_nb.config import load_config
    from sft_nb.memory import step_memory
    from sft_nb.models import resolve_model_path
    raw = json.loads((Path(resolve_model_path('tiny')) / 'config.json').read_text()) | {'vocab_size': 32768}
    (tmp_path / 'config.json').write_text(json.dumps(raw))
    cfg = load_config(None, [f'model.path={tmp_path}', 'tokenize.max_length=256', 'train.micro_batch_size=1',
                             'train.global_batch_size=1', 'model.lora_r=4', 'model.activation_checkpointing=full'])
    peak = step_memory(cfg, 1)[0]
    chunk = 255 * 32768 * 4  # 255 trained positions' fp32 logits
    assert peak['Temp'] >= chunk and peak['Activation'] + peak['Temp'] >= 2 * chunk, peak


def test_the_estimate_of_rows_without_padding_builds_no_attention_mask():
    """Rows without padding, each one sequence, run sdpa's causal kernel in the estimate's trace as in the run
    (`causal_sdpa`): the activations of a row twice as long are at most twice as large, not the T² of a [T, T] mask."""
    from sft_nb.config import load_config
    from sft_nb.memory import step_memory
    rows = lambda n: load_config(None, ['model.path=tiny', f'tokenize.max_length={n}', 'model.activation_checkpointing=full'])
    act = {n: step_memory(rows(n), 1, levers=False)[0]['Activation'] for n in (256, 512)}
    assert act[512] <= 2.02 * act[256], act


def test_cpu_estimate_of_a_quantized_base_counts_its_mapped_checkpoint():
    """On CPU ranks a quantized base's checkpoint stays mapped, the pages of its linears read while quantizing them in
    the rank's RSS: `estimate(device='cpu')` adds them as a part (fp32 tiny model: 4 bytes a weight) and its peak holds
    them; on GPUs that memory is the host's, not the GPU's, and the estimate leaves it out."""
    from sft_nb.config import load_config
    from sft_nb.memory import base_linears, estimate
    cfg = load_config(None, ['model.lora_r=8', 'model.quantize=nf4', 'tokenize.max_length=64'])
    r = estimate(cfg, device='cpu', data=False)['ranks'][0]
    assert r['parts']['mapped checkpoint'] == 4 * base_linears(cfg)[0], r['parts']
    assert r['peak'] == sum(r['at_peak'].values()) + r['parts']['runtime'] + r['parts']['mapped checkpoint']
    g = estimate(cfg, gpu_memory=24, data=False)['ranks'][0]
    assert 'mapped checkpoint' not in g['parts'] and g['peak'] == sum(g['at_peak'].values()), g['parts']
