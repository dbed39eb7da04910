"""Planted bugs show that the suite catches what matters.

Each mutant is a one-line bug in sft_nb/ (and, where the notebook that documents the code is named, the same line in its
cell: a notebook runs its own cells, not the package). For each, a fresh copy of sft_nb/, tests/, settings.ini (and nbs/
when a notebook is named) goes under build/mutants/, the edit is applied there, and every named check must fail on it:
the pytest node ids (`pytest -x`, exit 1 with a FAILED test: a collection or import error proves nothing) and each named
notebook (`nbdev_test`, failing on something other than an import). The named checks also run once on an unmutated copy,
first in the queue, and must all pass or no mutant is judged: a mutant is only caught by checks that pass without it. An
edit whose original text is not in its file exactly once stops everything: the list must not rot silently.

Only in-process checks can be named: Ray workers import sft_nb from the installed path, not from the copy. The pytest
and notebook runs are forks of one warm Python that imported torch, transformers, pytest and nbdev once (`FORK_SERVER`);
sft_nb is imported after the fork, from the copy. Forking the pytest runs took all 23 mutants of the time from 133 s to
82 s; forking the notebook runs too took these 44 from 167 s to 127 s (2026-12-07, this machine, one after the other).

    python tools/mutants.py                 every mutant, 2 at a time; exit 1 if one is missed
    python tools/mutants.py --list          the mutants, their edits and the checks that must catch them
    python tools/mutants.py --only NAME     one mutant (repeat --only for more), after its own checks' baseline
    python tools/mutants.py --passed build/junit.xml
                                            the named pytest checks that report lists as passed, on this tree (newer
                                            than every file of sft_nb/ and tests/), are not run again for the baseline
                                            (CI: the suite has just run them all); the notebooks' baseline still runs, as
                                            the suite ran them with their slow cells and a mutant's run does not
"""
from __future__ import annotations
import argparse, json, os, re, shutil, signal, subprocess, sys, tempfile, threading, time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / 'build' / 'mutants'
TIMEOUT = 600  # seconds for one pytest or notebook run
BROKEN = re.compile(r'(ModuleNotFoundError|ImportError|SyntaxError|IndentationError)\b')  # the mutant broke an import


@dataclass
class Mutant:
    name: str
    what: str  # the bug, in one line
    edits: list[tuple[str, str, str]]  # (path from the repo root, original text found there exactly once, its replacement)
    tests: list[str] = field(default_factory=list)  # pytest node ids that must fail
    notebooks: list[str] = field(default_factory=list)  # notebooks (nbdev_test) that must fail


def both(py: str, nb: str, original: str, replacement: str) -> list[tuple[str, str, str]]:
    "The same edit in a module and in the notebook cell it is exported from."
    return [(py, original, replacement), (nb, original, replacement)]


MUTANTS = [
    # ---- assistant-only masks
    Mutant('mask_eot_untrained', "the end-of-turn token closing each trained turn is not trained",
           [('sft_nb/spans.py', 'for a, z in ranges: mask[a:z] = [1] * (z - a)', 'for a, z in ranges: mask[a:z - 1] = [1] * (z - a - 1)')],
           tests=['tests/test_masks.py::test_masks_on_real_templates[chatml-multi-all_assistant]']),
    Mutant('mask_last_assistant_trains_all', "mode='last_assistant' trains every assistant turn",
           [('sft_nb/spans.py', 'trained = {asst[-1]}', 'trained = set(asst)')],
           tests=['tests/test_masks.py::test_masks_on_real_templates[chatml-multi-last_assistant]']),
    # ---- labels: the shift and the ignore index
    Mutant('labels_mask_shifted', "labels take the mask of the token before: the token after each trained one is the target",
           [('sft_nb/renderers.py', 'zip(ids[1:], mask[1:])', 'zip(ids[1:], mask[:-1])')],
           notebooks=['nbs/05_collate.ipynb']),
    Mutant('labels_first_token_a_target', "a sequence's first token is a target (in a packed row: predicted from the previous document)",
           [('sft_nb/renderers.py', 'return [-100] + [i if m else -100 for i, m in zip(ids[1:], mask[1:])]',
             'return [i if m else -100 for i, m in zip(ids, mask)]')],
           notebooks=['nbs/05_collate.ipynb']),
    Mutant('padding_trained', "a padded batch's padding is labelled with the pad id instead of -100, so it is trained",
           [('sft_nb/collate.py', 'ids[b, :n] = torch.as_tensor(i); labels[b, :n] = torch.as_tensor(labels_for(i, m))',
             'ids[b, :n] = torch.as_tensor(i); labels[b] = pad_id; labels[b, :n] = torch.as_tensor(labels_for(i, m))')],
           tests=['tests/test_packing.py::test_packed_equals_padded[two-sdpa-bool]']),
    Mutant('target_shifted_in_head', "the LM head scores each target from its own position instead of the one before",
           [('sft_nb/loss.py', 'sel[:, :-1] = nxt', 'sel[:, 1:] = nxt')],
           tests=['tests/test_loss.py::test_micro_batches_share_the_step_divisor']),
    # ---- packing and the packed document mask
    # RoPE under the dense block mask cannot see this one (a shift of a whole document is invisible to relative positions);
    # FlexAttention and sequence parallelism find the documents where position_ids restart at 0
    Mutant('packed_positions_run_on', "position_ids of a packed row run on across its documents instead of restarting at 0",
           both('sft_nb/collate.py', 'nbs/05_collate.ipynb', 'pos[b, start:start + n] = torch.arange(n)',
                'pos[b, start:start + n] = torch.arange(start, start + n)'),
           notebooks=['nbs/05_collate.ipynb']),
    Mutant('packed_mask_crosses_documents', "the packed block mask is causal only: a token attends to the earlier documents of its row",
           [('sft_nb/collate.py', 'm = same & causal & (seg[:, :, None] >= 0)', 'm = causal & (seg[:, :, None] >= 0)')],
           tests=['tests/test_packing.py::test_packed_equals_padded[two-sdpa-bool]']),
    Mutant('deal_contiguous', "ranks take contiguous blocks of a global batch instead of every dp-th item",
           both('sft_nb/packing.py', 'nbs/04_packing.ipynb', 'return [items[r::dp] for r in range(dp)]',
                'return [items[r * len(items) // dp:(r + 1) * len(items) // dp] for r in range(dp)]'),
           notebooks=['nbs/04_packing.ipynb']),
    # ---- the loss divisor across ranks and micro-batches
    Mutant('divisor_counts_one_replica', "the step's weight_sum counts the trained targets of the first replica only",
           [('sft_nb/dataplan.py', 'for mbs in batches for b in mbs]', 'for mbs in batches[:1] for b in mbs]')],
           tests=['tests/test_dataplan.py::test_step_divisor_sums_every_replica']),
    Mutant('divisor_per_micro_batch', "each micro-batch's loss is divided again by the micro-batch count (a mean of means)",
           [('sft_nb/backends/fsdp.py', '(s * scale + (a * aux_scale if aux else 0)).backward()',
             '(s * scale / len(micro_batches) + (a * aux_scale if aux else 0)).backward()')],
           tests=['tests/test_loss.py::test_micro_batches_share_the_step_divisor']),
    Mutant('rank_scale_dropped', "the worker's loss is not multiplied by the rank count FSDP's gradient average divides by",
           [('sft_nb/backends/fsdp.py', 'ranks = self.world_size if self.sharded else 1', 'ranks = 1')],
           tests=['tests/test_loss.py::test_two_ranks_equal_one_rank']),
    # ---- the in-process worker keeps Ray's copy semantics
    Mutant('local_group_shares_arguments', "the in-process worker is handed the driver's own objects: a worker that changes a batch changes the driver's",
           both('sft_nb/workers.py', 'nbs/07_workers.ipynb', 'args, kwargs = copy.deepcopy((args, kwargs))', 'pass'),
           notebooks=['nbs/07_workers.ipynb']),
    # ---- data order
    Mutant('sampler_same_order_every_epoch', "the random sampler ignores the epoch: every epoch repeats the first order",
           both('sft_nb/dataplan.py', 'nbs/05a_dataplan.ipynb', 'np.random.default_rng(self.seed + epoch)', 'np.random.default_rng(self.seed)'),
           notebooks=['nbs/05a_dataplan.ipynb']),
    Mutant('epoch_order_depends_on_earlier_draws', "an epoch's order depends on the orders the plan drew before, not on the step: a resumed run trains other rows",
           [('sft_nb/dataplan.py', 'self.sampler.order(epoch)', 'self.sampler.order(epoch + len(self._orders))')],
           tests=['tests/test_dataplan.py::test_global_batch_is_a_function_of_the_step']),
    # ---- the LR schedule
    Mutant('lr_warmup_starts_at_zero', "warmup starts at LR 0 and reaches the peak one step late",
           both('sft_nb/optim.py', 'nbs/07c_optim.ipynb', 'return lr * (step + 1) / warmup_steps', 'return lr * step / warmup_steps'),
           notebooks=['nbs/07c_optim.ipynb']),
    Mutant('lr_decay_spans_warmup', "the decay is spread over the warmup steps too: the last step's LR is above min_lr",
           [('sft_nb/optim.py', 'decay = max(1, total_steps - warmup_steps - 1)', 'decay = max(1, total_steps - 1)')],
           tests=['tests/test_optim.py::test_decay_spans_the_steps_after_warmup']),
    # ---- tokenization: truncation and the cache
    Mutant('truncation_keeps_mask_tail', "a truncated row keeps its first tokens but the last max_length entries of its mask",
           [('sft_nb/renderers.py', 'ids, mask, truncated = ids[:max_length], mask[:max_length], True',
             'ids, mask, truncated = ids[:max_length], mask[-max_length:], True')],
           tests=['tests/test_tokenize_data.py::test_truncation_keeps_the_first_tokens_with_their_mask']),
    Mutant('cache_key_ignores_max_length', "the tokenize cache key leaves out max_length: another max_length is served the old entry",
           both('sft_nb/cache.py', 'nbs/02b_cache.ipynb', 'spec.max_length, spec.truncation, fmt', 'spec.truncation, fmt'),
           notebooks=['nbs/02b_cache.ipynb']),
    Mutant('cache_checks_sizes_only', "a tokenize cache entry is checked by file sizes only: bytes altered in place are served",
           [('sft_nb/cache.py', "return next((n for n in sizes if file_digest(folder / n, 'xxh3') != recorded[n][1]), '')", "return ''")],
           tests=['tests/test_tokenize_data.py::test_cache_altered_in_place_is_detected']),
    # ---- checkpoints: integrity and resume
    Mutant('ckpt_digest_of_head_only', "a checkpoint file's digest covers its first 16 bytes only: a shard altered past them loads",
           [('sft_nb/checkpoint.py', "for block in iter(lambda: fh.read(1 << 20), b''): h.update(block)", 'h.update(fh.read(16))')],
           tests=['tests/test_reliability_probes.py::test_damaged_newest_checkpoint_named_and_latest_falls_back[shard_tail_flipped]']),
    Mutant('resume_rng_not_restored', "load_rng leaves torch's random stream as it is: dropout after a resume differs",
           [('sft_nb/workers.py', "torch.set_rng_state(t['torch'])", 'torch.set_rng_state(torch.get_rng_state())')],
           tests=['tests/test_reliability.py::test_checkpoint_rng_is_not_unpickled']),
    Mutant('resume_step_not_restored', "a worker's load reads its step count but keeps its own: the LR schedule goes on from there",
           [('sft_nb/backends/fsdp.py', "self.step = json.loads(Path(path, 'worker_state.json').read_text())['step']",
             "json.loads(Path(path, 'worker_state.json').read_text())['step']")],
           tests=['tests/test_reliability.py::test_worker_counts_on_from_its_checkpoint_step']),
    # ---- the chunked loss
    Mutant('loss_chunk_boundary', "backward chunks of the chunked LM head overlap by one token: the boundary row's gradient counts twice",
           both('sft_nb/loss.py', 'nbs/06c_loss.ipynb', 'for s in range(0, h.shape[0], ctx.chunk):',
                'for s in range(0, h.shape[0], max(1, ctx.chunk - 1)):'),
           tests=['tests/test_loss.py::test_linear_nll_equals_cross_entropy', 'tests/test_loss.py::test_worker_chunked_equals_one_shot'],
           notebooks=['nbs/06c_loss.ipynb']),
    Mutant('no_logits_view', "the chunked head's stand-in `.logits` is a view of the loss: FSDP2 warns, and an in-place op on it would skip the head's all-gather in backward",
           both('sft_nb/loss.py', 'nbs/06c_loss.ipynb', 'self.no_logits = self.loss.reshape(1)[:0].clone()', 'self.no_logits = self.loss.reshape(1)[:0]'),
           tests=['tests/test_loss.py::test_two_ranks_equal_one_rank'], notebooks=['nbs/06c_loss.ipynb']),
    # ---- distillation (train.loss kd)
    Mutant('kd_temperature_squared_dropped', "the distillation loss is not scaled by T²: its gradient shrinks as 1/T² at a temperature",
           both('sft_nb/loss.py', 'nbs/06c_loss.ipynb', 'c.kd_divergence, c.kd_beta) * (T * T)', 'c.kd_divergence, c.kd_beta)'),
           notebooks=['nbs/06c_loss.ipynb']),
    Mutant('kd_forward_kl_reversed', "forward_kl computes KL(student ‖ teacher) (mode-seeking) instead of KL(teacher ‖ student)",
           both('sft_nb/loss.py', 'nbs/06c_loss.ipynb', "if kind == 'forward_kl': return kl(teacher_logp, student_logp)",
                "if kind == 'forward_kl': return kl(student_logp, teacher_logp)"),
           notebooks=['nbs/06c_loss.ipynb']),
    Mutant('kd_teacher_positions_shifted', "the teacher's hidden states are taken one position late: the student learns the teacher's next-next token",
           both('sft_nb/loss.py', 'nbs/06c_loss.ipynb', 'self.h = h[self.sel]', 'self.h = h[self.sel.roll(1, 1)]'),
           notebooks=['nbs/06c_loss.ipynb']),
    Mutant('kd_eval_reports_train_loss', "evaluation of a kd run reports the distillation loss, not the NLL: its eval loss is not comparable with plain SFT's",
           [('sft_nb/backends/fsdp.py', 's, k, _ = self.nll(self.to_device(mb), objective=NLL())', 's, k, _ = self.nll(self.to_device(mb))')],
           tests=['tests/test_kd.py::test_kd_chunked_equals_one_shot_and_packed_equals_padded']),
    Mutant('kd_topk_rows_misaligned', "a batch's stored teacher top-k are concatenated in another order than its trained targets",
           both('sft_nb/collate.py', 'nbs/05_collate.ipynb', 'torch.cat([torch.tensor(e[k]) for e in examples])',
                'torch.cat([torch.tensor(e[k]) for e in examples[::-1]])'),
           notebooks=['nbs/05_collate.ipynb']),
    Mutant('kd_topk_not_renormalized', "offline KD softens the stored log-probabilities by T without renormalizing them over the k tokens",
           both('sft_nb/loss.py', 'nbs/06c_loss.ipynb', 't, s = torch.log_softmax(teacher_logits.logp.float() / T, -1), s.gather',
                't, s = teacher_logits.logp.float() / T, s.gather'),
           notebooks=['nbs/06c_loss.ipynb']),
    Mutant('kd_topk_teacher_unchecked', "a teacher top-k cache written by another teacher is used",
           both('sft_nb/topk.py', 'nbs/05c_topk.ipynb', "if meta['teacher']['teacher.weights'] != teacher['teacher.weights']:",
                'if False:'),
           notebooks=['nbs/05c_topk.ipynb']),
    # ---- trust no file
    Mutant('slices_shape_unchecked', "a checkpoint tensor of another shape than config.json builds is read as the model's shape",
           [('sft_nb/backends/slices.py', 'if rd.shape(k) != list(t.shape):', 'if False:')],
           tests=['tests/test_trust_no_file.py::test_a_tensor_of_other_shape_than_config_json_is_refused_by_both_modes']),
    Mutant('slices_load_unchecked', "the worker's slice loader reads the checkpoint unchecked (shapes, missing tensors): only every_rank refuses a bad folder",
           [('sft_nb/backends/fsdp.py', 'sources = check_checkpoint(meta, self.path)  # before any rank reads',
             'from .slices import checkpoint_files, checkpoint_sources; sources = checkpoint_sources(meta, checkpoint_files(self.path))  #')],
           # the hypothesis judge (test_slices_and_every_rank_agree_bitwise_or_both_refuse) catches it too, in 37 s
           tests=['tests/test_trust_no_file.py::test_a_tensor_of_other_shape_than_config_json_is_refused_by_both_modes',
                  'tests/test_trust_no_file.py::test_a_float_weight_stored_as_integers_is_refused_by_both_modes']),
    Mutant('pretokenized_ids_unbounded', "a pretokenized id past the tokenizer's vocabulary is kept (the worker dies on it at the first step)",
           [('sft_nb/renderers.py', "if (top := max(conv['input_ids'])) >= len(tokenizer) or", "if False and (top := max(conv['input_ids'])) >= len(tokenizer) or")],
           tests=['tests/test_trust_no_file.py::test_pretokenized_ids_are_checked_on_read']),
    # ---- memory levers
    Mutant('tiled_mlp_tile_detached', "each tile of the tiled MLP is cut from the graph: no gradient flows back through the MLP to the layers below it",
           [('sft_nb/levers.py', 'checkpoint(fwd, t, *args, use_reentrant=False, **kwargs)', 'checkpoint(fwd, t.detach(), *args, use_reentrant=False, **kwargs)')],
           tests=['tests/test_levers.py::test_worker_tiled_equals_untiled']),
    Mutant('lora_plus_ratio_dropped', "LoRA+: the schedule sets B's group to the plain LR after the first step",
           both('sft_nb/optim.py', 'nbs/07c_optim.ipynb', "g['lr'] = lr * g.get('lr_ratio', 1.0)", "g['lr'] = lr"),
           notebooks=['nbs/07c_optim.ipynb']),
    Mutant('nf4_export_onto_dequantized', "a quantized run's merged export goes onto the dequantized 4-bit weights, not the source checkpoint's",
           [('sft_nb/backends/fsdp.py', "model = self._build_model('cpu')  # the checkpoint's weights as stored",
             "model = self._build_model('cpu', __import__('torch').float32)  #")],
           tests=['tests/test_quantize.py::test_nf4_merged_export_is_source_plus_adapter']),
    # ---- padding-free micro-batches
    Mutant('padding_free_unused', "unpacked micro-batches stay right-padded where padding-free rows would be fewer",
           [('sft_nb/dataplan.py', 'if len(bins) < len(examples):', 'if False:')],
           tests=['tests/test_trainer.py::test_micro_batch_split_invariance[padding-free-0/1 weights]']),
    # ---- compiled blocks
    Mutant('compile_blocks_unused', "model.compile builds the compiled forwards but every block runs eager",
           [('sft_nb/backends/fsdp.py', 'if self.shared.failed or not torch.is_grad_enabled(): return self.eager(*args, **kwargs)',
             'return self.eager(*args, **kwargs)')],
           tests=['tests/test_compile.py::test_compiled_equals_eager_and_compiles_once_per_shape']),
    Mutant('compile_padded_static', "padded batches are not marked dynamic: a new length compiles again",
           [('sft_nb/backends/fsdp.py', 'if self.shared.padded: _mark_dynamic(args, kwargs)', 'pass')],
           tests=['tests/test_compile.py::test_compiled_equals_eager_and_compiles_once_per_shape']),
    # ---- run folders
    Mutant('unused_run_dir_ignores_steps', "a retired trainer deletes the run folder it made even when it trained a step there",
           both('sft_nb/checkpoint.py', 'nbs/07e_checkpoint.ipynb', "if (d / 'metrics.jsonl').exists() and _trained(d / 'metrics.jsonl'): return False",
                "if False: return False"),
           notebooks=['nbs/07e_checkpoint.ipynb']),
    Mutant('lora_base_fp32_under_bf16', "a bf16 LoRA run stores its frozen base in fp32 (twice the bytes; FSDP2 casts it at every gather anyway)",
           both('sft_nb/backends/fsdp.py', 'nbs/07a_backends.fsdp.ipynb', 'store_frozen_in(model, dtype)', 'None'),
           notebooks=['nbs/07a_backends.fsdp.ipynb']),
    Mutant('estimate_drops_logsumexp_temp', "the estimate's peak leaves out the temporary ATen's logsumexp makes inside itself for the loss's logits",
           [('sft_nb/memory.py', "if lse.peak['Total'] > peak['Total']: peak = lse.peak", "if False: peak = lse.peak")],
           tests=['tests/test_memory.py::test_estimate_counts_the_loss_logsumexp_temporary']),
    Mutant('estimate_builds_unpadded_mask', "the estimate's trace of unpadded rows builds the [T, T] attention mask the run skips",
           [('sft_nb/memory.py', "model.set_attn_implementation(causal_sdpa())", "pass")],
           tests=['tests/test_memory.py::test_the_estimate_of_rows_without_padding_builds_no_attention_mask']),
]


# ---- edits ---------------------------------------------------------------------------------------------------------
def _cells(nb: dict) -> list[dict]:
    return [c for c in nb['cells'] if c['cell_type'] == 'code']


def apply_edit(root: Path, path: str, original: str, replacement: str, write: bool = True):
    "Replace `original` (which must occur exactly once: in a notebook, across its code cells) under `root`; raise otherwise."
    f = root / path
    if not f.is_file(): raise ValueError(f"{path} does not exist")
    if f.suffix == '.ipynb':
        nb = json.loads(f.read_text())
        hits = [(c, ''.join(c['source'])) for c in _cells(nb)]
        n = sum(s.count(original) for _, s in hits)
    else:
        text = f.read_text()
        n = text.count(original)
    if n != 1: raise ValueError(f"{path}: {original!r} occurs {n} times, not once")
    if not write: return
    if f.suffix == '.ipynb':
        cell, src = next((c, s) for c, s in hits if original in s)
        cell['source'] = src.replace(original, replacement).splitlines(keepends=True)
        f.write_text(json.dumps(nb, indent=1, ensure_ascii=False))
    else: f.write_text(text.replace(original, replacement))


def copy_tree(tag: str, with_nbs: bool) -> Path:
    "A fresh copy of what the checks read, under build/mutants/."
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f'{tag}-', dir=BUILD))
    try: (BUILD / 'shared').symlink_to(ROOT.parent / 'shared')  # the development data beside the copy, as beside the checkout
    except FileExistsError: pass
    skip = shutil.ignore_patterns('__pycache__', '*.pyc', '.ipynb_checkpoints', '.hypothesis', '.pytest_cache')
    for d in ('sft_nb', 'tests') + (('nbs',) if with_nbs else ()): shutil.copytree(ROOT / d, tmp / d, ignore=skip)
    shutil.copy2(ROOT / 'settings.ini', tmp / 'settings.ini')
    home = tmp / 'home'; home.mkdir()  # caches of this copy only: a mutant's tokenization never lands in the shared cache
    models = Path(os.environ.get('SFT_NB_HOME', Path.home() / '.cache' / 'sft_nb')) / 'models'
    models.mkdir(parents=True, exist_ok=True)
    (home / 'models').symlink_to(models)  # the built test models (code no mutant touches) are shared
    return tmp


# ---- runs ----------------------------------------------------------------------------------------------------------
def env_for(tmp: Path) -> dict:
    env = {**os.environ, 'PYTHONPATH': str(tmp), 'SFT_NB_HOME': str(tmp / 'home'), 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1',
           'HF_DATASETS_OFFLINE': '1', 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'TOKENIZERS_PARALLELISM': 'false'}
    env.setdefault('OMP_NUM_THREADS', '1')  # two runs share the cores
    return env


def timed(fn, *args):
    t = time.perf_counter(); r = fn(*args); return r, time.perf_counter() - t


def run(cmd: list[str], tmp: Path) -> tuple[int, str]:
    if cmd[:3] == PYTEST and WARM.up(): return WARM.run('pytest', cmd[3:], tmp)
    if cmd[:2] == NBDEV_TEST and WARM.up(): return WARM.run('nbdev', cmd[2:], tmp)
    try:
        p = subprocess.run(cmd, cwd=tmp, env=env_for(tmp), capture_output=True, text=True, timeout=TIMEOUT)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        return -1, f"timed out after {TIMEOUT} s\n{e.stdout or ''}{e.stderr or ''}"


PYTEST = [sys.executable, '-m', 'pytest']

def pytest_cmd(ids: list[str], first_failure: bool) -> list[str]:
    return PYTEST + ['-q', '-p', 'no:cacheprovider', '-rfE'] + (['-x'] if first_failure else []) + ids


# A Python that has imported what every named check imports (torch, transformers' model code, pytest, nbdev's notebook
# runner: ~5 s of CPU) and not sft_nb; each pytest or notebook run is a fork of it in its copy (sft_nb, imported after the
# fork, comes from the copy). One thread only: a fork of a process with threads may hold their locks. It reads one job a
# line: [copy, 'pytest' or 'nbdev', argv, output file]; the forked run writes its exit code to output + '.rc' last, by a
# rename (a reader never sees it half written).
FORK_SERVER = r"""
import json, os, signal, sys, threading
import torch, numpy, pandas, pytest, transformers
import nbdev.test  # its settings are read in the run, from the copy's settings.ini
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2
if threading.active_count() != 1: sys.exit(f'fork server: {threading.active_count()} threads after the imports')
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the runs are reaped by the kernel
print('ready', flush=True)
for line in sys.stdin:
    tmp, kind, argv, out = json.loads(line)
    pid = os.fork()
    if pid:
        print(pid, flush=True); continue
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the tests wait for their own children
    fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0)
    os.chdir(tmp); sys.path.insert(0, tmp); os.environ.update(PYTHONPATH=tmp, SFT_NB_HOME=os.path.join(tmp, 'home'))
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(fd, 1); os.dup2(fd, 2)
    try:
        if kind == 'pytest': rc = int(pytest.main(argv))
        else: nbdev.test.nbdev_test(path=argv[0]); rc = 0  # one notebook: run in this process (nbdev_test's exit 1 on a failure)
    except SystemExit as e: rc = e.code if isinstance(e.code, int) else 1
    except BaseException as e: print(f'fork server run: {e!r}'); rc = 3
    sys.stdout.flush(); sys.stderr.flush()
    with open(out + '.rc.tmp', 'w') as f: f.write(str(rc))
    os.replace(out + '.rc.tmp', out + '.rc'); os._exit(rc)  # whole or absent: the parent polls for the file and reads it at once
"""


class ForkServer:
    "Runs of `pytest ARGV` or `nbdev_test --path NB` in a copy, forked from one warm Python (`FORK_SERVER`); started on first use, by one thread at a time."
    def __init__(self): self.proc, self.lock, self.failed = None, threading.Lock(), False
    def up(self) -> bool:
        with self.lock:
            if self.proc is None and not self.failed:
                env = {k: v for k, v in env_for(BUILD).items() if k not in ('PYTHONPATH', 'SFT_NB_HOME')}
                self.proc = subprocess.Popen([sys.executable, '-c', FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                if self.proc.stdout.readline().strip() != 'ready':  # a server that cannot start: every run is its own process
                    print('fork server did not start: each pytest run imports everything itself', flush=True)
                    self.proc.kill(); self.proc, self.failed = None, True
            return self.proc is not None
    def run(self, kind: str, argv: list[str], tmp: Path) -> tuple[int, str]:
        out = tmp / f'.{kind}-{time.monotonic_ns()}.log'
        with self.lock:
            self.proc.stdin.write(json.dumps([str(tmp), kind, argv, str(out)]) + '\n'); self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
        rc, deadline = Path(f'{out}.rc'), time.monotonic() + TIMEOUT
        while not rc.exists() and time.monotonic() < deadline: time.sleep(0.1)
        text = out.read_text(errors='replace') if out.exists() else ''
        if not rc.exists():
            try: os.kill(pid, signal.SIGKILL)
            except ProcessLookupError: pass
            return -1, f"timed out after {TIMEOUT} s\n{text}"
        return int(rc.read_text()), text
    def stop(self):
        if self.proc is not None: self.proc.stdin.close(); self.proc.wait(30); self.proc = None


WARM = ForkServer()


NBDEV_TEST = [str(Path(sys.executable).with_name('nbdev_test')), '--path']

def nbdev_cmd(nb: str) -> list[str]:
    return NBDEV_TEST + [nb]


def judge_pytest(rc: int, out: str) -> tuple[bool, str]:
    "(caught, why): caught only by a failing test, never by an error in collection or in a fixture."
    failed = re.findall(r'^FAILED (.+?)(?: - (.*))?$', out, re.M)  # a node id may hold spaces (its parameters' ids)
    if rc == 1 and failed:
        test, error = failed[0]
        if BROKEN.match(error): return False, f"{test} fails on {error[:160]}: the mutant broke an import"
        return True, test
    if rc == 0: return False, 'the tests pass'
    errors = re.findall(r'^ERROR (\S+.*)$', out, re.M)
    return False, f"exit {rc}, not a test failure: {errors[0] if errors else _last_line(out)}"


def judge_notebook(nb: str, rc: int, out: str) -> tuple[bool, str]:
    "(caught, why): caught only by a failing cell, never by an import the mutant broke."
    if rc == 0: return False, f'{nb} passes'
    if rc < 0: return False, f'{nb}: {_last_line(out)}'
    lines, cell = out.splitlines(), re.search(r'While Executing Cell #(\d+)', out)
    at = [k for k, l in enumerate(lines) if re.match(r'\w+(?:Error|Exception|Exit)\b', l)]
    error = ' '.join(l.strip() for l in lines[at[-1]:at[-1] + 3] if l.strip())[:160] if at else _last_line(out)  # test_eq: 3 lines
    where = nb + (f' cell {cell[1]}' if cell else '')
    if BROKEN.match(error): return False, f"{where} fails on {error}: the mutant broke an import"
    return True, f"{where}: {error}"


def _last_line(out: str) -> str:
    lines = [l for l in out.strip().splitlines() if l.strip()]
    return lines[-1][:200] if lines else '(no output)'


def check_mutant(m: Mutant, keep: bool) -> tuple[bool, str, float]:
    "(caught by every named check, what caught it or why not, seconds)."
    t0 = time.perf_counter()
    tmp = copy_tree(m.name, bool(m.notebooks))
    try:
        for path, original, replacement in m.edits: apply_edit(tmp, path, original, replacement)
        caught_by = []
        if m.tests:
            ok, why = judge_pytest(*run(pytest_cmd(m.tests, True), tmp))
            if not ok: return False, why, time.perf_counter() - t0
            caught_by.append(why)
        for nb in m.notebooks:
            ok, why = judge_notebook(nb, *run(nbdev_cmd(nb), tmp))
            if not ok: return False, why, time.perf_counter() - t0
            caught_by.append(why)
        return True, '; '.join(caught_by), time.perf_counter() - t0
    finally:
        if not keep: shutil.rmtree(tmp, ignore_errors=True)


def passed_in(junit: Path) -> set[str]:
    """The pytest node ids a JUnit report of this tree lists as passed (no failure, error or skip). A report older than a
    file of sft_nb/ or tests/ is of another tree: refused."""
    import xml.etree.ElementTree as ET
    newest = max(f.stat().st_mtime for d in ('sft_nb', 'tests') for f in (ROOT / d).rglob('*.py'))
    if junit.stat().st_mtime < newest: raise SystemExit(f"--passed {junit}: older than the code and tests it would vouch for")
    ok = {}
    for case in ET.parse(junit).getroot().iter('testcase'):
        nodeid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"  # tests.test_x + t[a] → tests/test_x.py::t[a]
        ok[nodeid] = not any(c.tag in ('failure', 'error', 'skipped') for c in case)
    whole = {}  # a test named without its parameters passed when every parametrization did
    for nodeid, passed in ok.items():
        if '[' in nodeid: whole[nodeid.split('[')[0]] = whole.get(nodeid.split('[')[0], True) and passed
    return {t for t, passed in (ok | whole).items() if passed}


def baseline_work(mutants: list[Mutant], jobs: int, passed: set[str] = frozenset()) -> list[tuple[str, list[str], set[str]]]:
    """(label, command, the checks it runs) of the unmutated runs: the named tests as `jobs` pytest runs (a share of the
    files each), but those in `passed`, and each notebook once."""
    tests = [t for t in dict.fromkeys(t for m in mutants for t in m.tests) if t not in passed]
    files = list(dict.fromkeys(t.split('::')[0] for t in tests))
    work = []
    for share in (files[k::jobs] for k in range(jobs)):
        ids = [t for t in tests if t.split('::')[0] in share]
        if ids: work.append((f"pytest {' '.join(Path(f).name for f in share)}", pytest_cmd(ids, False), set(ids)))
    seconds = json.loads((ROOT / 'tests' / 'durations.json').read_text())  # the longest notebook first, not last and alone
    nbs = sorted(dict.fromkeys(nb for m in mutants for nb in m.notebooks), key=lambda nb: -seconds.get(nb, 0))
    return work + [(nb, nbdev_cmd(nb), {nb}) for nb in nbs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--list', action='store_true', help='print the mutants and exit')
    ap.add_argument('--only', action='append', metavar='NAME', help='run only this mutant (repeatable)')
    ap.add_argument('--jobs', type=int, default=2, help='runs at once (default 2)')
    ap.add_argument('--keep', action='store_true', help='keep the copies under build/mutants/')
    ap.add_argument('--passed', type=Path, metavar='JUNIT', help="a JUnit report of this tree: its passed tests need no baseline run")
    a = ap.parse_args(argv)
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), 'mutant names repeat'
    unknown = [n for n in a.only or [] if n not in names]
    if unknown: ap.error(f"unknown mutant {', '.join(unknown)}; --list names them")
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only]
    rotten = []
    for m in chosen:  # every original is still there, exactly once, before anything runs
        for path, original, replacement in m.edits:
            try: apply_edit(ROOT, path, original, replacement, write=False)
            except ValueError as e: rotten.append(f"{m.name}: {e}")
    if rotten:
        print('the code these mutants edit has changed; update their edits in tools/mutants.py:\n  ' + '\n  '.join(rotten))
        return 2
    if a.list:
        for m in chosen:
            print(f"{m.name}: {m.what}")
            for path, original, replacement in m.edits: print(f"    {path}: {original!r}\n    {' ' * len(path)}→ {replacement!r}")
            for c in m.tests + m.notebooks: print(f"    caught by {c}")
        return 0
    t0 = time.perf_counter()
    passed = passed_in(a.passed) if a.passed else set()
    base = copy_tree('baseline', any(m.notebooks for m in chosen))
    try:
        rc, out = run([sys.executable, '-c', 'import sft_nb; print(sft_nb.__file__)'], base)
        if rc or not out.strip().startswith(str(base)):
            print(f"baseline: sft_nb does not import from the copy {base}: {out.strip()}")
            return 1
        failing, missed = set(), []
        with ThreadPoolExecutor(a.jobs) as pool:  # the unmutated runs first, the mutants as the runs free up
            work = {pool.submit(timed, run, cmd, base): (label, checks) for label, cmd, checks in baseline_work(chosen, a.jobs, passed)}
            mutants = {pool.submit(check_mutant, m, a.keep): m for m in chosen}
            for f in as_completed(work):
                (label, checks), ((rc, out), dt) = work[f], f.result()
                if rc != 0:
                    failing |= checks
                    failed = re.findall(r'^(?:FAILED|ERROR) (.+?)(?: - .*)?$', out, re.M)
                    print(f"baseline: {label} fails unmutated (exit {rc}, {dt:.0f} s): {', '.join(failed) or _last_line(out)}", flush=True)
                    print('\n'.join(f'    | {l}' for l in out.strip().splitlines()[-60:]), flush=True)  # why, for a failure seen only in CI
                else: print(f"baseline: {label} passes ({dt:.0f} s)", flush=True)
            n, vouched = sum(len(c) for _, c in work.values()), {t for m in chosen for t in m.tests} & passed
            print(f"baseline: the {n} named checks run {'do NOT all pass' if failing else 'pass'} unmutated "
                  f"({time.perf_counter() - t0:.0f} s)" + (f"; {len(vouched)} more passed in {a.passed}" if vouched else ''), flush=True)
            if failing:
                for f in mutants: f.cancel()
                return 1
            for f in as_completed(mutants):
                m, (ok, why, dt) = mutants[f], f.result()
                if not ok: missed.append(m.name)
                print(f"{'caught' if ok else 'MISSED'}  {m.name:<32} {dt:5.0f} s  {why}", flush=True)
    finally:
        WARM.stop()
        if not a.keep: shutil.rmtree(base, ignore_errors=True)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} mutants caught in {time.perf_counter() - t0:.0f} s"
          + (f"; missed: {', '.join(missed)}" if missed else ''))
    return 1 if missed else 0


if __name__ == '__main__':
    sys.exit(main())
