"""Issue 30 in a real JupyterLab + headless Chromium (the harness of tests/test_browser.py): `interactive.ipynb` on a
tool-calling file and a reasoning file (tests/fixtures) with a shipped template by name (`template = 'qwen3'`, which
renders tool calls and reasoning) and max_length 440 with truncation 'keep_start' (the longer tool-call examples, 451-459
tokens, are cut), a few steps of Fit, then a chat in the panel: type, Send, the reply streams in (several partial texts
seen on the page) and is what the kernel's chat box holds. No red stderr box from the workers' weight loading. Then, in
the kernel, the notebook's own inspector is walked over every row of both files: its examples' ids and masks are the
ones the trainer's data plan trains for that row (cut rows included), and the page shows the cut row as truncated.
Screenshots: build/browser/panel_chat.png, build/browser/inspector_truncated.png."""
from __future__ import annotations
import json, re, shutil
from pathlib import Path
import pytest
from test_browser import lab, browser, Notebook, LAB_DIR, ROOT, _status  # noqa: F401 (fixtures used by name)

pytestmark = pytest.mark.timeout(900)
FIX = ROOT / 'tests' / 'fixtures'
PARAMS = {'train_data': "'tool_calls.jsonl,reasoning.jsonl'", 'template': "'qwen3'", 'max_length': '440', 'truncation': "'keep_start'",
          'num_steps': '40', 'eval_every': '20'}
# run in the notebook's kernel (%run -i): the displayed inspector against the trainer's data plan, row by row
ONE_TRUTH = """import json
from sft_nb.lens import train_source_names
bad, n, cut = [], 0, []
for name, ds in zip(train_source_names(trainer), trainer.data.train_sets):
    inspector.source.value, trained = name, {}
    for k in range(len(ds)): trained.setdefault(int(ds[k]['index']), []).append((list(ds[k]['input_ids']), list(ds[k]['loss_mask'])))
    for i, want in trained.items():
        inspector.row.value = i
        shown = [(list(e.input_ids), list(e.loss_mask)) for e in inspector.examples]
        n += len(want); bad += [[name, i]] * (shown != want)
        cut += [[name, i, len(e.input_ids)] for e in inspector.examples if e.truncated]
print('ONE-TRUTH', json.dumps({'n': n, 'bad': bad, 'cut': cut, 'max_length': trainer.cfg.tokenize.max_length}))
inspector.source.value, inspector.row.value = cut[0][0], cut[0][1]
"""


def _notebook(name: str) -> str:
    "interactive.ipynb with PARAMS set in its parameters cell (what papermill -p does), next to its data, in the lab folder."
    for f in ('tool_calls.jsonl', 'reasoning.jsonl'): shutil.copy(FIX / f, LAB_DIR / f)
    (LAB_DIR / 'one_truth.py').write_text(ONE_TRUTH)
    nb = json.loads((ROOT / 'examples' / 'interactive.ipynb').read_text())
    params = next(c for c in nb['cells'] if 'parameters' in c['metadata'].get('tags', []))
    src = ''.join(params['source'])
    for k, v in PARAMS.items():
        src, n = re.subn(rf'^{k} = [^#\n]*', f'{k} = {v}  ', src, flags=re.M)
        assert n == 1, f'interactive.ipynb has no parameter {k}'
    params['source'] = src.splitlines(keepends=True)
    (LAB_DIR / name).write_text(json.dumps(nb))
    return name


def test_chat_in_panel_on_agent_data(lab, browser):
    nb = Notebook(browser, lab, _notebook('interactive_agent.ipynb'))
    nb.run_all()
    panel = nb.page.locator('.sft-nb-panel')
    nb.page.locator('.sft-nb-data', has_text='data:').wait_for(timeout=60_000)
    data = nb.page.locator('.sft-nb-data').text_content()  # Run All left the page at the last cell: off screen, innerText is ''
    panel.scroll_into_view_if_needed()
    assert 'tool_calls.jsonl' in data and 'reasoning.jsonl' in data, data  # both files train
    panel.locator('button', has_text=re.compile(r'^\s*Fit\s*$')).click()
    nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('done: every step ran')", timeout=300_000)
    assert 'step 40/40' in _status(nb)
    # every text the streaming reply shows, as the page sees it
    nb.page.evaluate('''() => { window.__stream = []; const out = document.querySelector('.sft-nb-chat-output');
        new MutationObserver(() => { const s = out.querySelector('.sft-nb-chat-streaming');
            if (s) window.__stream.push(s.textContent); }).observe(out, {subtree: true, childList: true, characterData: true}); }''')
    box = nb.page.locator('.sft-nb-chat-input textarea')
    box.click(); box.type('What is the weather in Paris?')
    nb.page.locator('.sft-nb-chat-send').click()
    nb.page.locator('.sft-nb-chat-output .sft-nb-chat-user', has_text='What is the weather in Paris?').wait_for(timeout=60_000)
    nb.page.wait_for_function("() => document.querySelector('.sft-nb-chat-output .sft-nb-chat-assistant:not(.sft-nb-chat-streaming)')", timeout=300_000)
    shown = nb.page.locator('.sft-nb-chat-output .sft-nb-chat-assistant').inner_text()
    partial = nb.page.evaluate('() => [...new Set(window.__stream)]')
    assert len(partial) >= 3, partial  # the reply grew on the page piece by piece
    final = shown.removeprefix('model:').strip()
    assert final, shown  # after 40 steps the model says something visible (not only blanks or special tokens)
    assert all(final.startswith(p.removeprefix('model:').strip().rstrip('▌').strip()) for p in partial), (partial, final)
    cell = nb.run_new_cell("import json; print('CHAT', json.dumps(panel.chat.messages))")
    out = cell.locator('.jp-OutputArea-output', has_text='CHAT')
    out.wait_for(timeout=60_000)
    msgs = json.loads(out.inner_text().split('CHAT', 1)[1])
    assert msgs[0] == {'role': 'user', 'content': 'What is the weather in Paris?'} and msgs[1]['role'] == 'assistant'
    assert msgs[1]['content'].strip() == final  # the page shows what the kernel's chat holds
    stderr = nb.page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').all_inner_texts()
    assert not [s for s in stderr if 'Loading weights' in s], stderr  # the workers' load progress is not a red box
    nb.page.set_viewport_size({'width': 1400, 'height': 1900})  # the whole panel: buttons, chart, samples, chat, log
    panel.scroll_into_view_if_needed(); nb.shot('panel_chat', panel)
    cell = nb.run_new_cell('%run -i one_truth.py')
    out = cell.locator('.jp-OutputArea-output', has_text='ONE-TRUTH')
    out.wait_for(timeout=120_000)
    truth = json.loads(out.inner_text().split('ONE-TRUTH', 1)[1])
    assert truth['bad'] == [] and truth['n'] >= 48, truth  # every example of both files: the inspector's ids and mask are the trained ones
    assert truth['cut'] and all(n == 440 for *_, n in truth['cut']), truth  # cut rows among them, cut where training cuts them
    assert truth['max_length'] == 440
    ins = nb.page.locator('.jp-OutputArea-output .sft-nb-inspector').first
    ins.locator('.widget-html', has_text='truncated: yes').wait_for(timeout=60_000)  # the page shows the cut row as cut
    assert ins.locator('.widget-slider .widget-readout').inner_text().strip() == str(truth['cut'][0][1])
    ins.scroll_into_view_if_needed(); nb.shot('inspector_truncated', ins)
    nb.check_clean()
    cell = nb.run_new_cell("trainer.shutdown(); print('workers stopped')")
    cell.locator('.jp-OutputArea-output', has_text='workers stopped').wait_for(timeout=120_000)
    nb.close()
