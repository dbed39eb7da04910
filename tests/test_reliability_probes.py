"""Reliability behaviours not covered elsewhere: leftovers of killed writers cleaned (only stale ones), a template's huge
allocations refused, odd types in JSON a run reads back named, damaged checkpoint files named (with a fallback), a full
disk during save named, "no usable rows" with each row's reason.

Where each reliability behaviour is shown (`::test_x` is in this file; other tests/ files are named; nbs/… are notebook test cells, run by nbdev_test):

| behaviour | test |
|---|---|
| resuming never runs a `.metadata` or shard payload (`__reduce__`) | test_reliability_ckpt.py::test_dcp_metadata_payload_never_runs, ::test_shard_bytes_payload_never_runs; nbs/07e_checkpoint (read_dcp_metadata) |
| `latest` never points outside run_dir | test_reliability_ckpt.py::test_latest_marker_cannot_leave_the_run |
| a kernel interrupt inside a step lets it finish: driver and workers stay in step | test_reliability_ckpt.py::test_interrupt_inside_a_step_finishes_it[forward_backward/optim_step], ::test_interrupt_timer_around_fit; nbs/08a_callbacks (hold_interrupts) |
| `running` and `action` say what the trainer is doing, during and after fit | nbs/08_trainer (`t.running, t.action` during and after fit) |
| a dead worker group refuses every action; save never prunes a good checkpoint | test_reliability_ckpt.py::test_dead_group_refuses_every_action_and_restarts_from_last_good |
| a full disk during save keeps the earlier checkpoint, the workers and the trained state; freed, save() works again | ::test_disk_full_during_save_names_the_space (earlier checkpoint, latest, no .tmp_step kept); test_reliability_models.py::test_a_full_disk_during_save_keeps_the_workers_and_the_trained_steps (a real tmpfs); nbs/07_workers (write_error) |
| a refused `sft-nb run` keeps the earlier run's record, advises in `-p` words; `-p overwrite true` leaves nothing old | test_reliability_signals.py::test_refused_run_keeps_the_earlier_record_in_run_words_and_overwrite_leaves_nothing_old; nbs/11_cli (in_parameter_words) |
| a resume that changes the data stream (edited file, fewer rows, global batch) is refused naming key and values; lr and more steps are recorded | test_run_identity.py; nbs/05a_dataplan (check_resume), nbs/05b_stream (a streamed file edited), nbs/08_trainer (record_resume) |
| max_length beyond the model's positions, a folder needing its own code, a damaged safetensors header, mixed row formats are named | test_reliability_models.py; nbs/06_models (check_context, check_no_remote_code, check_weights), nbs/01_data (normalize_row) |
| an eval set may not be named `heldout` (the name of the data.eval_fraction split) | nbs/05a_dataplan (`an eval set is named 'heldout'`) |
| flipped floats are caught by digests; another model's checkpoint is refused | test_reliability_ckpt.py::test_flipped_floats_fall_back_with_a_warning, ::test_checkpoint_of_another_model_is_refused |
| a trainer_state.json with an impossible `global_step` is refused, nothing deleted | test_reliability_ckpt.py::test_trainer_state_is_validated_and_nothing_deleted |
| `~` in checkpoint.run_dir / tokenize.cache_dir is the home folder | nbs/07e_checkpoint (`run_dir='~/runs/x'`), nbs/02_tokenize (`cache_root('~/tok')`) |
| leftover `.KEY.tmp*` of a killed tokenization cleaned, live ones kept | ::test_killed_tokenization_leftovers_are_cleaned_a_live_ones_kept; nbs/00a_paths (live_tmp, clean_stale_tmp) |
| leftover `.tmp_step_*` of a killed save cleaned, live ones kept | ::test_checkpoint_leftovers_cleaned_only_when_their_writer_is_gone; nbs/07e_checkpoint (claim cleans) |
| duplicate JSON keys are a bad row naming the key | nbs/01b_jsonl (`key 'content' appears twice in one object`) |
| SIGTERM saves at the next step boundary: `sft-nb train` | test_reliability_signals.py::test_sigterm_saves_at_the_next_step_and_resumes_exactly, ::test_signal_before_the_first_step_stops_named_and_leaves_no_run (imports, setup; SIGTERM and SIGINT) |
| SIGTERM saves at the next step boundary: `sft-nb run` | test_reliability_signals.py::test_sigterm_in_sft_nb_run_saves_at_the_next_step; nbs/11_cli (SignalStop, one mechanism for train and run), nbs/08a_callbacks (SaveOnSignal, in the kernel) |
| a `"\\ud800"` row is a bad row | test_peer_masks.py::test_lone_surrogate_is_a_bad_row |
| a full disk during save names the space | ::test_disk_full_during_save_names_the_space[ENOSPC/torch's message] |
| "no usable rows" lists rows and reasons, in the API and the CLI | test_reliability_signals.py::test_no_usable_rows_lists_rows_and_reasons (unknown role), ::test_no_usable_rows_in_the_cli_gives_each_rows_reason (alpaca on chat data, max_length 4) |
| `{"data": [...]}` is recognised as a list of rows under 'data' | nbs/01b_jsonl (`its rows look like the list under 'data'`) |
| `chat_template=/missing.jinja` names the missing file | nbs/02a_templates (`names no file`) |
| YAML errors in overrides and `run -f` name the override and the file | test_reliability_signals.py::test_yaml_errors_name_the_override_and_the_file |
| a truncated `metrics.jsonl` is named and its cut line dropped | ::test_truncated_metrics_jsonl_is_named_and_its_cut_line_dropped; nbs/08a_callbacks (JSONLTracker.truncate) |
| truncated `trainer_state.json`, truncated/deleted shards, deleted `worker_state.json` are named; `latest` falls back | ::test_damaged_newest_checkpoint_named_and_latest_falls_back |
| a cache commit survives a slow rename (OSError 39) | nbs/02_tokenize (hidden cell: commit_entry after the first entry landed) |
| a config-only model folder is named as having no tokenizer | nbs/06_models (`has config.json but no tokenizer`) |
| a Ray OOM kill while workers start is named | nbs/07_workers (death_message on Ray's memory-monitor text); not run on a real OOM |
| odd types in `trainer_state.json` / `report.json` are named (cache entry rebuilt) | ::test_odd_types_in_trainer_state_step_metrics_are_named, ::test_odd_types_in_report_json_are_named_and_rebuilt; test_reliability_ckpt.py (total_steps '4') |
| a template's allocations are bounded (`'a' * 10**8` refused) | ::test_template_allocation_is_bounded; test_reliability_templates.py (every render path × payload: values, loops, recursion, sandbox escapes); nbs/02a_templates (bounded_template payloads) |
| other payloads (YAML billion laughs, JSON nested past the reader, links in and to checkpoints) are refused | test_reliability_payloads.py |
"""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import pytest
from sft_nb.config import TokenizeConfig
from sft_nb.tokenize import tokenize_dataset

CHAT = [{'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]}]


def _writer(root: Path):
    "Another process writing a temp folder of the cache (what a tokenization does), until it is killed."
    code = (f"import time; from pathlib import Path; from sft_nb.paths import live_tmp\nwith live_tmp(Path({str(root)!r}), '.abc.tmp') as t:\n"
            "    (t / 'data').mkdir(); print(t, flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
    return p, Path(p.stdout.readline().strip())


def test_killed_tokenization_leftovers_are_cleaned_a_live_ones_kept(tmp_path, tiny_tok):
    "`.KEY.tmp*` folders of a killed tokenization are cleaned from the cache; a concurrent live one survives."
    (killed, k_dir), (live, l_dir) = _writer(tmp_path), _writer(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL); killed.wait()
        old = tmp_path / '.0123.tmpxyz'  # 3 days old and unlocked: no live writer names it
        (old / 'data').mkdir(parents=True); os.utime(old, (time.time() - 3 * 86400,) * 2)
        tokenize_dataset(CHAT, tiny_tok, cache_dir=str(tmp_path))
        assert not k_dir.exists() and not old.exists() and l_dir.exists()
        assert len([p for p in tmp_path.iterdir() if not p.name.startswith('.')]) == 1  # the new entry
    finally: live.kill(); live.wait()


@pytest.mark.parametrize('payload', ["{{ 'a' * 10**8 }}", "{{ [0] * 10**9 }}", "{{ 'a'|center(10**9) }}", "{{ '%999999999s' % 'a' }}",
                                     "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"])
def test_template_allocation_is_bounded(tiny_tok, payload):
    "A template allocating `'a' * 10**8` (or 10**10: out of memory) is refused by the sandbox before it is made."
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" + payload
    with pytest.raises(Exception, match=r"chat template given in tokenize\.chat_template \(.*\): .* would make [\d,]+ characters or items \(limit 16,777,216\)"):
        tokenize_dataset(CHAT, tiny_tok, TokenizeConfig(chat_template=template), use_cache=False)


def test_odd_types_in_report_json_are_named_and_rebuilt(tmp_path, tiny_tok):
    "`report.json` of a cache entry with odd types (manifest rewritten to match) is named with the field, and the entry rebuilt."
    from sft_nb.cache import _manifest
    ds, rep = tokenize_dataset(CHAT, tiny_tok, cache_dir=str(tmp_path))
    [entry] = [p for p in tmp_path.iterdir() if not p.name.startswith('.')]
    (entry / 'report.json').write_text(json.dumps({**rep.to_dict(), 'n_kept': 'one'}))
    (entry / 'MANIFEST.json').write_text(json.dumps(_manifest(entry)))
    with pytest.warns(UserWarning, match=rf"{entry / 'report.json'}: field 'n_kept' is 'one', expected a non-negative integer; rebuilding it"):
        _, again = tokenize_dataset(CHAT, tiny_tok, cache_dir=str(tmp_path))
    assert again == rep


@pytest.mark.parametrize('record, message', [({'step': 1, 'loss': [1]}, "step_metrics[0] field 'loss' is [1], expected a number"),
                                             ({'step': '1', 'loss': 1.0}, "step_metrics[0] field 'step' is '1'"),
                                             ('x', 'step_metrics are out of range')])
def test_odd_types_in_trainer_state_step_metrics_are_named(tmp_path, record, message):
    "Odd types in trainer_state.json's step_metrics are refused at resume, naming the file and the field."
    from sft_nb.checkpoint import CheckpointError, Checkpointer
    from sft_nb.config import CheckpointConfig
    ck = Checkpointer(CheckpointConfig(run_dir=str(tmp_path / 'run'))); ck.claim()
    try:
        path = ck.save(1, lambda tmp: None, {'global_step': 1, 'total_steps': 4, 'step_metrics': [record]})
        with pytest.raises(CheckpointError, match=rf"{path / 'trainer_state.json'}: .*{message}".replace('[', r'\[').replace(']', r'\]')):
            ck.resolve(str(path))
    finally: ck.release()


@pytest.mark.parametrize('fault', [OSError(28, 'No space left on device'),
                                   RuntimeError("worker rank 0 failed in save: CheckpointException(ranks: {0: [RuntimeError('[enforce fail "
                                                "at inline_container.cc:626] . unexpected pos 704 vs 598')]})")])
def test_disk_full_during_save_names_the_space(tmp_path, fault):
    "A full disk during save (ENOSPC, or torch's `unexpected pos 704 vs 598`) is named as no space, and the earlier checkpoint kept."
    from sft_nb.checkpoint import CheckpointError, Checkpointer
    from sft_nb.config import CheckpointConfig
    ck = Checkpointer(CheckpointConfig(run_dir=str(tmp_path / 'run'), keep_last=1)); ck.claim()
    try:
        good = ck.save(1, lambda tmp: (tmp / 'shard').write_bytes(b'x'), {'global_step': 1, 'total_steps': 4, 'step_metrics': [{'step': 1}]})
        def full(tmp):
            (tmp / 'shard').write_bytes(b'half')
            raise fault
        with pytest.raises(CheckpointError, match=rf"checkpoint {ck.dir / 'step_000002'} not saved: no space left on the disk of {ck.dir} "
                                                  r"\(\d+ MiB free there\)\. The trained state of step 2 is still in memory and the earlier "
                                                  r"checkpoints are kept: free space, then save again \(trainer\.save\(\)\)$"):
            ck.save(2, full, {'global_step': 2, 'total_steps': 4, 'step_metrics': [{'step': 1}, {'step': 2}]})
        assert ck.checkpoints() == [good] and (ck.dir / 'latest').read_text() == good.name and not list(ck.dir.glob('.tmp_step_*'))
    finally: ck.release()


def test_truncated_metrics_jsonl_is_named_and_its_cut_line_dropped(tmp_path):
    "A `metrics.jsonl` cut short by a kill is named, and its cut line dropped (on resume and in compare)."
    import warnings
    from sft_nb.callbacks import JSONLTracker
    from sft_nb.runs import read_run
    (tmp_path / 'config.yaml').write_text('train: {num_steps: 4}\n')
    m = tmp_path / 'metrics.jsonl'
    m.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match=rf"{m}: its last line 3 is cut short"):
        assert read_run(tmp_path)['metrics']['step'].tolist() == [1, 2]
    with pytest.warns(UserWarning, match=rf"{m}: line 3 is not valid JSON \(cut short"):
        JSONLTracker(m).truncate(2)  # what a resume from step 2 does
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert [json.loads(l)['step'] for l in m.read_text().splitlines()] == [1, 2] and len(read_run(tmp_path)['metrics']) == 2
    m.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # damaged inside, not cut short: an error naming the line
    with pytest.raises(ValueError, match=rf"{m}: line 2 is not JSON"): read_run(tmp_path)
    (tmp_path / 'summary.json').write_text('{"steps": 4, "fin')
    m.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'summary.json'}: not valid JSON"): read_run(tmp_path)


def _flip_tail(f: Path):
    "Flip the last 4 bytes of `f` in place."
    b = bytearray(f.read_bytes()); b[-4:] = bytes(x ^ 0xFF for x in b[-4:]); f.write_bytes(bytes(b))


@pytest.mark.parametrize('damage, message', [
    (lambda ck: (ck / 'trainer_state.json').write_text('{"global_step": 4, "tot'), r'trainer_state\.json: its content differs'),
    (lambda ck: (ck / '__0_0.distcp').write_bytes((ck / '__0_0.distcp').read_bytes()[:5]), r'__0_0\.distcp: its content differs'),
    (lambda ck: (ck / '__0_0.distcp').unlink(), r'__0_0\.distcp is missing; the checkpoint is incomplete'),
    (lambda ck: (ck / 'worker_state.json').unlink(), r'worker_state\.json is missing; the checkpoint is incomplete'),
    (lambda ck: (ck / 'digests.json').unlink(), r'digests\.json is missing'),
    pytest.param(lambda ck: _flip_tail(ck / '__0_0.distcp'), r'__0_0\.distcp: its content differs', id='shard_tail_flipped')])
def test_damaged_newest_checkpoint_named_and_latest_falls_back(tmp_path, damage, message):
    """Truncated trainer_state.json, truncated, deleted or altered shards (the last bytes flipped in place: same size, same
    head), a deleted worker_state.json: named by file; 'latest' falls back."""
    from sft_nb.checkpoint import CheckpointError, Checkpointer
    from sft_nb.config import CheckpointConfig
    ck = Checkpointer(CheckpointConfig(run_dir=str(tmp_path / 'run'), keep_last=3)); ck.claim()
    def write(tmp):
        (tmp / '__0_0.distcp').write_bytes(os.urandom(64)); (tmp / 'worker_state.json').write_text('{"rank": 0}')
    try:
        for s in (2, 4): ck.save(s, write, {'global_step': s, 'total_steps': 4, 'step_metrics': [{'step': i + 1} for i in range(s)]})
        damage(ck.dir / 'step_000004')
        with pytest.raises(CheckpointError, match=message): ck.resolve(str(ck.dir / 'step_000004'))
        with pytest.warns(UserWarning, match=rf'checkpoint.resume=latest: skipping step_000004: .*{message}'):
            assert ck.resolve('latest') == ck.dir / 'step_000002'
    finally: ck.release()


@pytest.mark.parametrize('source, tokenize, reason', [
    ({'format': 'alpaca'}, {}, "row 0: mixed_formats: looks like messages (messages), the source's rows like Alpaca"),
    ({}, {'max_length': 4}, 'row 0: too_long: 24 tokens > max_length 4')])
def test_no_usable_rows_in_the_cli_gives_each_rows_reason(tmp_path, source, tokenize, reason):
    "'no usable rows' in the CLI gives each row's reason (a CLI user has no trainer.data_report), never 'has no rows; mixing the others'."
    import yaml
    data = tmp_path / 'rows.jsonl'
    data.write_text('\n'.join(json.dumps({'messages': [{'role': 'user', 'content': 'hello there'}, {'role': 'assistant', 'content': 'general kenobi'}]})
                              for _ in range(3)) + '\n')
    cfg = tmp_path / 'cfg.yaml'
    cfg.write_text(yaml.safe_dump({'model': {'path': 'tiny'}, 'data': {'train': [{'path': str(data), **source}]},
                                   'tokenize': {**tokenize, 'cache_dir': str(tmp_path / 'cache')},
                                   'checkpoint': {'run_dir': str(tmp_path / 'run')}}))
    r = subprocess.run([str(Path(sys.executable).parent / 'sft-nb'), 'train', str(cfg)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'HF_HUB_OFFLINE': '1'})
    assert r.returncode == 2 and 'no usable rows after tokenization: 3 of 3 rows dropped' in r.stderr and reason in r.stderr, r.stderr[-2000:]
    assert 'has no rows; mixing the others' not in r.stderr and 'Traceback' not in r.stderr


def test_checkpoint_leftovers_cleaned_only_when_their_writer_is_gone(tmp_path):
    "`.tmp_step_*` folders of a killed save are cleaned; a live trainer's save in progress never is."
    import socket
    from sft_nb.checkpoint import Checkpointer, RunDirBusy
    from sft_nb.config import CheckpointConfig
    cfg = CheckpointConfig(run_dir=str(tmp_path / 'run'), resume='latest')
    live = Checkpointer(cfg); live.claim()
    saving = live.dir / '.tmp_step_000003'
    (saving / 'shard').parent.mkdir(parents=True); (saving / 'shard').write_bytes(b'x')  # the live trainer's save, mid-way
    with pytest.raises(RunDirBusy): Checkpointer(cfg).claim()
    assert saving.exists()
    live.release()
    gone = subprocess.Popen([sys.executable, '-c', 'pass']); gone.wait()  # a trainer killed mid-save: its lock names a dead PID
    (tmp_path / 'run' / '.lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': gone.pid, 'start': None}))
    after = Checkpointer(cfg); after.claim()
    try: assert not saving.exists() and not list(after.dir.glob('.tmp_step_*'))
    finally: after.release()
