"""Model folders and files that cannot train right are named before anything starts: max_length beyond the model's
positions, a folder that needs its own code (never run, no prompt), a damaged safetensors header, a file of mixed row
formats; a failed save keeps the workers and the trained state."""
import json, shutil, subprocess
from pathlib import Path
import pytest
from sft_nb.checkpoint import CheckpointError, verify_checkpoint
from sft_nb.config import ConfigError
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer
from helpers import cli, run_cfg

ROWS = identity_rows()['train']


def _model_copy(tiny_path, d: Path, **config) -> Path:
    "A copy of the tiny model folder with `config` merged into its config.json."
    shutil.copytree(tiny_path, d)
    cfg = json.loads((d / 'config.json').read_text())
    (d / 'config.json').write_text(json.dumps({**cfg, **config}))
    return d


def test_max_length_beyond_the_models_positions_is_refused(tiny_path, tmp_path):
    "tokenize.max_length 339 on a model with max_position_embeddings 64: a ConfigError naming both numbers and the override."
    model = _model_copy(tiny_path, tmp_path / 'm64', max_position_embeddings=64)
    t = SFTTrainer(run_cfg(model, tmp_path / 'run', tokenize__max_length=339), train_data=ROWS)
    with pytest.raises(ConfigError, match=r"tokenize\.max_length: 339 is beyond the 64 positions the model covers \(max_position_embeddings in "
                                          r".*config\.json\).*tokenize\.extend_context=true"):
        t.setup()
    assert t.group is None


def test_a_folder_that_needs_its_own_code_is_named_and_never_run(tiny_path, tmp_path):
    """A model folder with auto_map and a model_type transformers does not ship: the trainer and `sft-nb inspect` name the
    folder and its auto_map, ask nothing, give no restart hint, and the folder's code never runs."""
    model = _model_copy(tiny_path, tmp_path / 'quill', model_type='quillnet',
                        auto_map={'AutoConfig': 'quill.QuillConfig', 'AutoModelForCausalLM': 'quill.QuillModel'})
    marker = tmp_path / 'ran'
    (model / 'quill.py').write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(ConfigError, match=rf"model\.path: {model} needs its own Python code to load \(config\.json: model_type 'quillnet'.*"
                                          r'auto_map \{"AutoConfig": "quill\.QuillConfig"') as e:
        SFTTrainer(run_cfg(model, tmp_path / 'run'), train_data=ROWS).setup()
    assert 'restart_workers' not in str(e.value) and 'trust_remote_code=True' not in str(e.value)
    data = tmp_path / 'rows.jsonl'
    data.write_text(json.dumps(ROWS[0]) + '\n')
    code, out, err = cli('inspect', data, '--model', model)  # a terminal: transformers would ask [y/N] and run the code on y
    assert code != 0 and 'needs its own Python code to load' in err and '[y/N]' not in out + err, (out, err)
    assert not marker.exists()


def test_a_damaged_safetensors_header_is_named(tiny_path, tmp_path):
    "A model.safetensors whose header claims 10^15 bytes: the file and what is wrong are named, without the restart hint."
    model = _model_copy(tiny_path, tmp_path / 'bad')
    w = model / 'model.safetensors'
    w.write_bytes((10**15).to_bytes(8, 'little') + w.read_bytes()[8:])
    with pytest.raises(ConfigError, match=rf"model\.path: {w} is damaged: its header claims 1,000,000,000,000,000 bytes, the file has [\d,]+ bytes") as e:
        SFTTrainer(run_cfg(model, tmp_path / 'run'), train_data=ROWS).setup()
    assert 'restart_workers' not in str(e.value)


def test_rows_of_another_format_say_what_they_look_like(tiny_tok, tmp_path):
    "A file of messages rows then Alpaca rows: each Alpaca row is dropped as looking like Alpaca while the file's rows are messages (and the reverse)."
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    alpaca = [{'instruction': f'Add {k} and 1', 'input': '', 'output': str(k + 1)} for k in range(25)]
    for name, rows, bad, looks, file_is in (('msgs_first', ROWS[:25] + alpaca[:2], [25, 26], 'Alpaca (instruction, input, output)', 'messages'),
                                            ('alpaca_first', alpaca + ROWS[:3], [25, 26, 27], 'messages (messages)', 'Alpaca')):
        f = tmp_path / f'{name}.jsonl'
        f.write_text(''.join(json.dumps(r) + '\n' for r in rows))
        ds, rep = tokenize_dataset(str(f), tiny_tok, TokenizeConfig(max_length=512), cache_dir=str(tmp_path / 'cache'))
        assert [i for i, _, _ in rep.bad_rows] == bad and len(ds) == len(rows) - len(bad)
        assert all(kind == 'mixed_formats' and msg.startswith(f"looks like {looks}, the source's rows like {file_is}") for _, kind, msg in rep.bad_rows), rep.bad_rows


def _mount_tmpfs(where: Path, mib: int) -> bool:
    "A real small disk (tmpfs) at `where` when this user may mount one (root); else False."
    where.mkdir()
    return subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={mib}m', 'tmpfs', str(where)], capture_output=True).returncode == 0


def test_a_full_disk_during_save_keeps_the_workers_and_the_trained_steps(tiny_path, tmp_path, ray_session):
    """On a real 48 MiB disk filled up after step 1's checkpoint: saving step 2 fails with a short message (what, where,
    free space, what to do), the workers stay alive with step 2 in memory, and after space is freed save() succeeds and
    training goes on."""
    disk = tmp_path / 'disk'
    if not _mount_tmpfs(disk, 48): pytest.skip('mounting a tmpfs needs root here; tests/test_reliability_probes.py::test_disk_full_during_save_names_the_space injects the error')
    try:
        t = SFTTrainer(run_cfg(tiny_path, disk / 'run', train__num_steps=3, logging__trackers=[]), train_data=ROWS)
        try:
            t.fit(1); first = t.save()
            filler = disk / 'filler'
            with open(filler, 'wb') as f: f.write(b'\0' * (shutil.disk_usage(disk).free - 2**20))  # 1 MiB left
            t.fit(1)
            with pytest.raises(CheckpointError) as e: t.save()
            msg = str(e.value)
            assert msg.startswith(f"checkpoint {t.ckpt.dir / 'step_000002'} not saved: no space left on the disk of {t.ckpt.dir} (")
            assert 'MiB free there). The trained state of step 2 is still in memory' in msg and 'trainer.save()' in msg and len(msg.replace(str(t.ckpt.dir), 'DIR')) < 250, msg  # short, whatever the tmp path
            assert t.group.dead is None and t.global_step == 2 and t.checkpoints() == [first]
            filler.unlink()
            again = t.save()
            assert again.name == 'step_000002' and verify_checkpoint(again)['global_step'] == 2
            assert t.fit()['step'].tolist() == [1, 2, 3]
        finally: t.shutdown()
    finally: subprocess.run(['umount', '-l', str(disk)], capture_output=True)
