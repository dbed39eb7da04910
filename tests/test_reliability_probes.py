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
