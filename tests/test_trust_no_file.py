"""Trust no file: a model folder, a checkpoint or a data file is checked against its own header and config.json before
it is used. The worker's two load modes (`model.load: slices`: each rank reads its rows; `every_rank`: transformers reads
it all), each through `FSDPWorker.build`, build bitwise the same model or refuse with the same named error; no folder's
code runs from any entry point; bad ids, sizes, dtypes and paths are named by row, file, tensor or parameter."""
import json, shutil, subprocess, warnings
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from sft_nb.backends.fsdp import FSDPWorker
from sft_nb.backends.slices import check_checkpoint, load_pretrained
from sft_nb.config import ConfigError, ModelConfig, OptimConfig, TokenizeConfig
from sft_nb.models import model_config
from sft_nb.tokenize import tokenize_dataset
from helpers import cli, run_cfg


# ---- the two load modes, in this process -----------------------------------------------------------------------------

def outcome(load, path):
    """('ok', full state, tied) or ('refused', message) of the worker's build with `model.load: load`: `FSDPWorker.build`
    as a sharded run calls it (bf16 mixed precision shards on one rank too), in a 1-rank gloo group of this process."""
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = FSDPWorker(0, 1, ModelConfig(path=str(path), load=load), OptimConfig(), total_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            try: m = w.build(torch.bfloat16)
            except ConfigError as e: return ('refused', str(e))
        return ('ok', w.full_state(), m.get_output_embeddings().weight is m.get_input_embeddings().weight)
    finally: dist.destroy_process_group()


def assert_agree(path):
    "Both modes build bitwise the same model (tied alike), or both refuse with the same message; returns that outcome."
    a, b = outcome('slices', path), outcome('every_rank', path)
    assert a[0] == b[0], (a[:1] + a[1:][:1] if a[0] == 'refused' else a[:1], b[:1] + b[1:][:1] if b[0] == 'refused' else b[:1])
    if a[0] == 'refused': assert a[1] == b[1], (a[1], b[1])
    else:
        assert a[2] == b[2] and a[1].keys() == b[1].keys()
        for k in a[1]: assert a[1][k].dtype == b[1][k].dtype and torch.equal(a[1][k], b[1][k]), k
    return a


# ---- random small checkpoints ----------------------------------------------------------------------------------------

DTYPES = {'F32': torch.float32, 'F16': torch.float16, 'BF16': torch.bfloat16}


def write_checkpoint(d: Path, arch='qwen2', hidden=16, kv=2, layers=1, vocab=24, tied=True, dtype='F32', sharded=False, seed=0,
                     fault='none') -> Path:
    "A random model folder (config.json + safetensors, one file or two with an index) with one `fault` planted."
    Cfg = {'qwen2': Qwen2Config, 'llama': LlamaConfig}[arch]
    cfg = Cfg(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=kv, tie_word_embeddings=tied, max_position_embeddings=64)
    torch.manual_seed(seed)
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).state_dict().items()}
    if tied: state.pop('lm_head.weight', None)
    kproj = 'model.layers.0.self_attn.k_proj.weight'
    if fault == 'kproj_rows': state[kproj] = state[kproj][: state[kproj].shape[0] // 2].contiguous()  # half the rows config.json asks
    if fault == 'drop': state.pop('model.norm.weight')
    if fault == 'int_weight': state['model.norm.weight'] = (state['model.norm.weight'] * 3).to(torch.int32)  # a quantized save's ints
    if fault == 'head_differs': state['lm_head.weight'] = torch.randn(vocab, hidden).to(DTYPES[dtype])
    if fault == 'head_same': state['lm_head.weight'] = state['model.embed_tokens.weight'].clone()
    if fault == 'config_kv': cfg.num_key_value_heads = kv // 2 if kv > 1 else kv * 2  # config.json and the file disagree
    d.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(d)
    keys = sorted(state)
    parts = {'model.safetensors': keys} if not sharded else {'model-00001-of-00002.safetensors': keys[: len(keys) // 2],
                                                               'model-00002-of-00002.safetensors': keys[len(keys) // 2:]}
    for f, ks in parts.items(): save_file({k: state[k] for k in ks}, str(d / f), metadata={'format': 'pt'})
    if sharded:
        wmap = {k: f for f, ks in parts.items() for k in ks}
        if fault == 'wrong_shard': wmap[keys[0]] = 'model-00002-of-00002.safetensors'
        (d / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': wmap}))
        if fault == 'missing_shard': (d / 'model-00002-of-00002.safetensors').unlink()
    if fault == 'truncated':  # the last file's last tensor cut in half: a header that promises more than the file holds
        last = d / sorted(parts)[-1]
        n = int.from_bytes(last.read_bytes()[:8], 'little')
        end = max(e['data_offsets'][1] - e['data_offsets'][0] for k, e in json.loads(last.read_bytes()[8:8 + n]).items() if k != '__metadata__')
        last.write_bytes(last.read_bytes()[:-(end // 2) or -1])
    return d


FAULTS = ('none', 'none', 'truncated', 'kproj_rows', 'drop', 'int_weight', 'head_differs', 'head_same', 'config_kv', 'wrong_shard', 'missing_shard')


@pytest.mark.timeout(240)  # no load may hang (a short read once looped forever)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(['qwen2', 'llama']), hidden=st.sampled_from([8, 16]), kv=st.sampled_from([1, 2, 4]),
       layers=st.integers(1, 2), vocab=st.integers(16, 40), tied=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
       sharded=st.booleans(), seed=st.integers(0, 3), fault=st.sampled_from(FAULTS))
def test_slices_and_every_rank_agree_bitwise_or_both_refuse(tmp_path_factory, arch, hidden, kv, layers, vocab, tied, dtype, sharded, seed, fault):
    "For any small checkpoint (shapes, dtypes, tied or not, sharded or not, damaged or not) the two load modes build bitwise the same model or both refuse alike."
    d = write_checkpoint(tmp_path_factory.mktemp('ck'), arch, hidden, kv, layers, vocab, tied, dtype, sharded, seed, fault)
    got = assert_agree(d)
    planted = fault not in ('none', 'head_differs', 'head_same') and (sharded or fault not in ('wrong_shard', 'missing_shard'))
    assert (got[0] == 'refused') == planted, (fault, got[:1])
    if got[0] == 'ok': assert got[2] == tied  # the config's tie_word_embeddings decides, whatever the file holds


# ---- each numbered defect of the probes --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_truncated_last_tensor_is_named_not_a_hang(tmp_path):
    "The file's last tensor with half its rows: both modes refuse, naming the file and the tensor, at once."
    d = write_checkpoint(tmp_path / 'm', fault='truncated')
    got = assert_agree(d)
    assert got[0] == 'refused' and f"{d}/model.safetensors is damaged: tensor" in got[1] and '(truncated)' in got[1], got


def test_a_file_head_other_than_the_tied_embedding_is_warned_and_unused(tmp_path):
    "config.json ties the head, the file holds a head of other values: a warning names it, both modes build the tied model from embed_tokens."
    d = write_checkpoint(tmp_path / 'm', tied=True, fault='head_differs')
    with pytest.warns(UserWarning, match=r"holds lm_head\.weight with other values than model\.embed_tokens\.weight; config\.json ties them"):
        check_checkpoint(AutoModelForCausalLM.from_config(model_config(d), dtype=torch.float32), d)
    got = assert_agree(d)
    assert got[0] == 'ok' and got[2] and torch.equal(got[1]['lm_head.weight'], load_file(d / 'model.safetensors')['model.embed_tokens.weight'])
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # the same values (an old save of both): nothing to warn about
        check_checkpoint(AutoModelForCausalLM.from_config(model_config(write_checkpoint(tmp_path / 's', fault='head_same'))), tmp_path / 's')


def test_a_tensor_of_other_shape_than_config_json_is_refused_by_both_modes(tmp_path):
    "k_proj stored as [8, 16] where config.json builds [16, 16]: both modes refuse, naming the tensor, the file and both shapes."
    d = write_checkpoint(tmp_path / 'm', hidden=16, kv=4, fault='kproj_rows')
    got = assert_agree(d)
    assert got[0] == 'refused' and "model.layers.0.self_attn.k_proj.weight is [8, 16] in" in got[1] and "config.json builds has [16, 16]" in got[1], got


def test_a_float_weight_stored_as_integers_is_refused_by_both_modes(tmp_path):
    "model.norm.weight stored as int32 (cast to floats it would load as garbage): both modes refuse, naming the file, the tensor and its dtype."
    d = write_checkpoint(tmp_path / 'm', fault='int_weight')
    got = assert_agree(d)
    assert got[0] == 'refused' and f"{d}/model.safetensors stores model.norm.weight as torch.int32, not floats" in got[1], got


def test_num_key_value_heads_other_than_the_file_is_refused_by_both_modes(tmp_path):
    "num_key_value_heads 1 in config.json, 2 heads in the file: both modes refuse (no half-read k/v tensors)."
    d = write_checkpoint(tmp_path / 'm', hidden=16, kv=2, fault='config_kv')
    got = assert_agree(d)
    assert got[0] == 'refused' and "k_proj.weight is [8, 16]" in got[1] and "has [4, 16]" in got[1] and 'num_key_value_heads' in got[1], got


def test_shards_missing_or_mismatched_with_the_index_are_named(tmp_path):
    "A shard the index names that is not there, or a tensor the index puts in the wrong shard: the file is named (both modes)."
    got = assert_agree(write_checkpoint(tmp_path / 'a', sharded=True, fault='missing_shard'))
    assert got[0] == 'refused' and 'puts tensors in model-00002-of-00002.safetensors, missing from' in got[1], got
    got = assert_agree(write_checkpoint(tmp_path / 'b', sharded=True, fault='wrong_shard'))
    assert got[0] == 'refused' and 'which does not hold it (model-00001-of-00002.safetensors does)' in got[1], got


def test_an_untied_model_without_a_head_is_refused_by_both_modes(tmp_path):
    "tie_word_embeddings false and no lm_head.weight in the file: transformers would draw a random head; both modes refuse, saying why."
    d = write_checkpoint(tmp_path / 'm', tied=False)
    sd = load_file(d / 'model.safetensors'); sd.pop('lm_head.weight')
    save_file(sd, str(d / 'model.safetensors'), metadata={'format': 'pt'})
    got = assert_agree(d)
    assert got[0] == 'refused' and "has no tensor for the model's lm_head.weight (config.json unties the head" in got[1], got


# ---- no folder's code runs, from any entry point ---------------------------------------------------------------------

@pytest.fixture
def quill(tiny_path, tmp_path):
    "A model folder whose config.json needs its own code (auto_map, a model_type transformers does not ship); running it would write `ran`."
    d = tmp_path / 'quill'
    shutil.copytree(tiny_path, d)
    cfg = json.loads((d / 'config.json').read_text())
    (d / 'config.json').write_text(json.dumps({**cfg, 'model_type': 'quillnet', 'auto_map': {'AutoConfig': 'quill.QuillConfig',
                                                                                        'AutoModelForCausalLM': 'quill.QuillModel'}}))
    (d / 'quill.py').write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    return d


def test_no_entry_point_runs_a_model_folders_code(quill, tmp_path):
    """Every way a model folder is read refuses a folder that needs its own code, naming it, and its code never runs: the
    library (config, tokenizer and model loaders, the trainer, the estimate, the run scorer), the CLI (train, estimate, inspect,
    pack) and a notebook's parameters (`sft-nb run -p model ...`)."""
    from sft_nb.lens import RunScorer
    from sft_nb.models import load_model_inputs, load_tokenizer
    from sft_nb.memory import estimate
    from sft_nb.config import load_config
    from sft_nb.trainer import SFTTrainer
    rows = tmp_path / 'rows.jsonl'
    rows.write_text(json.dumps({'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]}) + '\n')
    cfg = run_cfg(quill, tmp_path / 'run'); cfg['data'] = {'train': [{'path': str(rows)}]}
    run = tmp_path / 'run_q'; run.mkdir()
    import yaml
    (run / 'config.yaml').write_text(yaml.safe_dump(cfg))
    cfg_file = tmp_path / 'quill.yaml'; cfg_file.write_text(yaml.safe_dump(cfg))
    library = {'model_config': lambda: model_config(quill), 'load_model_inputs': lambda: load_model_inputs(str(quill)),
               'load_tokenizer': lambda: load_tokenizer(str(quill)), 'load_pretrained': lambda: load_pretrained(AutoModelForCausalLM, quill),
               'SFTTrainer.setup': lambda: SFTTrainer(cfg).setup(), 'estimate': lambda: estimate(load_config(cfg), gpu_memory=80),
               'RunScorer': lambda: RunScorer(run)}
    for name, call in library.items():
        with pytest.raises(ConfigError, match='needs its own Python code to load'): call()
    commands = {'train': ('train', cfg_file), 'estimate': ('estimate', cfg_file, '--gpus', '1', '--gpu-memory', '80'),
                'inspect': ('inspect', rows, '--model', quill), 'pack': ('pack', rows, '--model', quill),
                'run (notebook parameter)': ('run', Path(__file__).parents[1] / 'examples' / 'train.ipynb', '-p', 'model', str(quill),
                                             '-p', 'run_dir', str(tmp_path / 'nb_run'), '-p', 'max_steps', '1')}
    for name, args in commands.items():
        code, out, err = cli(*args)
        assert code != 0 and 'needs its own Python code to load' in out + err and '[y/N]' not in out + err, (name, out[-2000:], err[-2000:])
    assert not (tmp_path / 'ran').exists()


def test_a_user_sampler_module_is_stated_as_code_where_the_parameter_is_documented():
    "`sampler: 'module:Class'` imports and runs that module: the notebook's parameter line and the README say so."
    root = Path(__file__).parents[1]
    nb = json.loads((root / 'examples' / 'train.ipynb').read_text())
    line = next(l for c in nb['cells'] for l in ''.join(c['source']).splitlines() if l.startswith('sampler:'))
    assert "imports and runs that module's code" in line, line
    assert '**imports and runs that module**' in (root / 'README.md').read_text()


# ---- the estimate's inputs ----------------------------------------------------------------------------------------------

def test_estimate_inputs_are_validated_by_name(tiny_path, tmp_path):
    "sft-nb estimate: --gpus 0, --nodes 0, --gpu-memory -1 are refused naming the flag; a config.json that leaves sizes to transformers' defaults names them."
    import yaml
    cfg_file = tmp_path / 'c.yaml'
    cfg_file.write_text(yaml.safe_dump(run_cfg(tiny_path, tmp_path / 'run')))
    for flag, value in (('--gpus', '0'), ('--nodes', '0'), ('--gpu-memory', '-1')):
        code, out, err = cli('estimate', cfg_file, '--gpus', '1', '--gpu-memory', '80', flag, value)
        assert code != 0 and f'({flag})' in err and 'Traceback' not in err, (flag, out, err)
    bare = tmp_path / 'bare'; bare.mkdir()
    (bare / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
    cfg_file.write_text(yaml.safe_dump(run_cfg(bare, tmp_path / 'run')))
    code, out, err = cli('estimate', cfg_file, '--gpus', '1', '--gpu-memory', '80')
    assert code != 0 and 'does not say vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads' in err, (out, err)
    (bare / 'config.json').write_text(json.dumps({'model_type': 't5', 'd_model': 64}))
    code, out, err = cli('estimate', cfg_file, '--gpus', '1', '--gpu-memory', '80')
    assert code != 0 and "is a 't5' model (T5Config), which transformers builds no causal language model of" in err, (out, err)


# ---- rows and files ---------------------------------------------------------------------------------------------------

def test_pretokenized_ids_are_checked_on_read(tiny_tok, tmp_path):
    "Pretokenized rows: an id past the vocabulary, a negative id, 2**40, and float ids are each that row's named error; good rows train."
    import pandas as pd
    n = len(tiny_tok)
    rows = [{'input_ids': [1, 2, 3], 'loss_mask': [0, 1, 1]}, {'input_ids': [1, n + 50, 3], 'loss_mask': [0, 1, 1]},
            {'input_ids': [1, 2**40], 'loss_mask': [0, 1]}, {'input_ids': [5, -1], 'loss_mask': [0, 1]},
            {'input_ids': [4, 5, 6], 'loss_mask': [0, 1, 1]}]
    f = tmp_path / 'ids.parquet'
    pd.DataFrame(rows).to_parquet(f)
    floats = tmp_path / 'floats.parquet'
    pd.DataFrame({'input_ids': [[1.5, 20.7], [1.0, 2.0]], 'loss_mask': [[0, 1], [0, 1]]}).to_parquet(floats)
    ds, rep = tokenize_dataset(str(f), tiny_tok, TokenizeConfig(max_length=64), cache_dir=str(tmp_path / 'cache'))
    assert list(ds['index']) == [0, 4], rep.bad_rows
    reasons = {i: m for i, _, m in rep.bad_rows}
    assert f"id {n + 50} at position 1 is outside the tokenizer's {n} ids" in reasons[1]
    assert f"id {2**40} at position 1 is outside" in reasons[2] and "id -1 at position 1 is outside" in reasons[3]
    ds, rep = tokenize_dataset(str(floats), tiny_tok, TokenizeConfig(max_length=64), cache_dir=str(tmp_path / 'cache'))
    assert len(ds) == 0 and all('position 0 holds 1.5, not an integer token id' in m or 'position 0 holds 1.0' in m for _, _, m in rep.bad_rows), rep.bad_rows


def test_a_message_too_large_to_render_is_that_rows_error(tiny_tok, tmp_path):
    "A 20M-character assistant message: that row is dropped with its size named; the source's other rows train (not 'fix the template')."
    big = {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'x' * 20_000_000}]}
    ok = {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]}
    ds, rep = tokenize_dataset([ok, big, ok], tiny_tok, TokenizeConfig(max_length=64))
    assert len(ds) == 2 and [(i, m.split(',')[0]) for i, _, m in rep.bad_rows] == [(1, 'message 1 is 20')], rep.bad_rows
    assert 'split or drop this row' in rep.bad_rows[0][2] and 'fix the template' not in rep.bad_rows[0][2]


def test_a_file_with_cr_line_ends_says_so(tiny_tok, tmp_path):
    "A JSONL file whose rows end with CR alone: the reason names the carriage returns and the fix, not only 'not valid JSON'."
    f = tmp_path / 'cr.jsonl'
    row = json.dumps({'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]})
    f.write_bytes(('\r'.join([row] * 6) + '\r').encode())
    with pytest.raises(Exception, match=r"carriage returns \(CR\) between rows.*convert it"):
        tokenize_dataset(str(f), tiny_tok, TokenizeConfig(max_length=64), cache_dir=str(tmp_path / 'cache'))


def test_a_full_disk_during_the_cache_write_names_the_folder_and_setting(tiny_tok, tmp_path):
    "Tokenizing into a cache on a full disk (a real 1 MiB tmpfs): a ConfigError names the folder and tokenize.cache_dir; no entry is left."
    disk = tmp_path / 'disk'; disk.mkdir()
    if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(disk)], capture_output=True).returncode:
        pytest.skip('mounting a tmpfs needs root')
    try:
        rows = [{'messages': [{'role': 'user', 'content': f'question {i} ' * 20}, {'role': 'assistant', 'content': f'answer {i} ' * 40}]}
                for i in range(2000)]
        f = tmp_path / 'rows.jsonl'; f.write_text(''.join(json.dumps(r) + '\n' for r in rows))
        with pytest.raises(ConfigError, match=rf"tokenize\.cache_dir: no space left in {disk}.*tokenize\.cache_dir \(the cache_dir parameter\)"):
            tokenize_dataset(str(f), tiny_tok, TokenizeConfig(max_length=512), cache_dir=str(disk))
        assert not [p for p in disk.iterdir() if not p.name.startswith('.')]  # no entry committed
    finally: subprocess.run(['umount', str(disk)])


def test_a_cache_entry_that_cannot_be_read_is_rebuilt_with_a_warning(tiny_tok, tmp_path):
    "An entry whose parts cannot be read (its manifest rewritten to match): a warning names the entry, then it is rebuilt; not silent."
    from sft_nb.cache import _manifest
    rows = [{'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': f'hello {i}'}]} for i in range(4)]
    f = tmp_path / 'rows.jsonl'; f.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    spec = TokenizeConfig(max_length=64)
    tokenize_dataset(str(f), tiny_tok, spec, cache_dir=str(tmp_path / 'cache'))
    (entry,) = [p for p in (tmp_path / 'cache').iterdir() if not p.name.startswith('.')]
    (entry / 'data' / 'state.json').write_text('{"_data_files": [{"filename": "gone.arrow"}]}')
    (entry / 'MANIFEST.json').write_text(json.dumps(_manifest(entry)))
    with pytest.warns(UserWarning, match=rf"tokenization cache entry {entry} cannot be read .*; rebuilding it"):
        ds, _ = tokenize_dataset(str(f), tiny_tok, spec, cache_dir=str(tmp_path / 'cache'))
    assert len(ds) == 4


def test_an_export_that_did_not_finish_is_refused_by_loaders(tiny_path, tmp_path, monkeypatch):
    """save_hf_folder stopped halfway leaves the earlier export whole and nothing beside it; a folder a killed writer
    left (its marker still in it) is refused by the trainer's path check and the every_rank loader by name."""
    import shutil
    from sft_nb.models import EXPORT_PARTIAL, check_model_path
    from sft_nb.workers import save_hf_folder
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    out = tmp_path / 'hf'
    save_hf_folder(model, out, str(tiny_path))
    earlier = {f.name: f.read_bytes() for f in out.iterdir()}
    from transformers import AutoTokenizer
    def dies(*a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(AutoTokenizer, 'from_pretrained', dies)  # stopped after the weights, before the tokenizer
    with pytest.raises(KeyboardInterrupt): save_hf_folder(model, out, str(tiny_path))
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in out.iterdir()} == earlier and [p.name for p in tmp_path.iterdir()] == ['hf']
    assert not (out / EXPORT_PARTIAL).exists() and check_model_path(str(out)) == str(out)
    left = tmp_path / '.hf.partial_killed'; shutil.copytree(out, left); (left / EXPORT_PARTIAL).write_text('')
    for load in (check_model_path, lambda p: load_pretrained(AutoModelForCausalLM, p)):
        with pytest.raises(ConfigError, match=rf"model\.path: {left} is an export that did not finish"): load(str(left))
