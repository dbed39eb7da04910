"""Notebook views: the inspector over every glaive row (checked against an independent per-turn
oracle), the template linter on every real template, the batch heatmap, the dataset report, the
papermill example, and a real-browser screenshot of the inspector."""
import html
import json
from pathlib import Path
import re
import numpy as np
import pytest
from transformers import AutoTokenizer
from jupyter_lab import screenshot_tool
from sft_nb.batchviz import MASKED, PAD, TRAINED, batch_fig, batch_grid
from sft_nb.collate import collate_packed, collate_padded
from sft_nb.formats import normalize_row
from sft_nb.datareport import dataset_report
from sft_nb.inspect import COLORS, ROLE_COLORS, Inspector, inspect_main, example_markup
from sft_nb.models import load_tokenizer
from sft_nb.lint import CHECKS, failed, lint_template
from sft_nb.models import smollm2_chat_template
from sft_nb.templates import FAMILY_SPECIALS, add_family_specials, chat_ids, collapse_template, render
from sft_nb.config import TokenizeConfig
from sft_nb.config import TokenizeConfig
from sft_nb.renderers import tokenize_conversation
from sft_nb.tokenize import tokenize_dataset

CHIP = re.compile(r'<span class="k (y|n) r-(\w+)" style="[^"]*" title="[^"]*">(.*?)</span>', re.S)


@pytest.fixture(scope='module')
def glaive(shared):
    return json.loads((shared / 'datasets' / 'glaive_toolcall_en_demo.json').read_text())


@pytest.fixture(scope='module')
def qwen(tiny_path, shared):
    "(tokenizer with Qwen2.5's special tokens, Qwen2.5 template)."
    tok = add_family_specials(AutoTokenizer.from_pretrained(tiny_path), 'qwen2.5-instruct')
    return tok, (shared / 'templates' / 'qwen2.5-instruct.jinja').read_text()


def oracle_ranges(tok, template, msgs, tools):
    """Character ranges of each message in the full render, found without sft_nb's locator: an assistant
    turn is what rendering it adds after the generation prompt (minus trailing newlines: content, tool
    calls and end-of-turn); user/tool content is found verbatim, in order."""
    full = render(tok, msgs, tools, template=template)
    out, cursor = [], 0
    for i, m in enumerate(msgs):
        if m['role'] == 'assistant':
            prefix = render(tok, msgs[:i], tools, template=template, add_generation_prompt=True)
            upto = render(tok, msgs[:i + 1], tools, template=template)
            assert full.startswith(upto) and upto.startswith(prefix), f'message {i}: the template is not append-only'
            end = len(upto.rstrip('\n'))
            out.append(('assistant', len(prefix), end)); cursor = end
        elif m['content']:
            j = full.find(m['content'], cursor)
            assert j >= 0, f'message {i}: content not in the render'
            out.append((m['role'], j, j + len(m['content']))); cursor = j + len(m['content'])
    return full, out


def test_inspector_over_every_glaive_row(shared, qwen, glaive):
    tok, template = qwen
    ins = Inspector(shared / 'datasets' / 'glaive_toolcall_en_demo.json', tok, TokenizeConfig(chat_template=template, max_length=None))  # every row, long ones too
    assert ins.row.max == len(glaive) - 1 == 299
    n_asst = n_other = 0
    for i, raw in enumerate(glaive):
        ins.row.value = i
        ex = ins.example
        assert ex is not None, f'row {i}: {ins.error}'
        conv = normalize_row(raw, 'sharegpt')
        assert ex.input_ids == chat_ids(tok, conv['messages'], conv['tools'], template=template)
        chips = CHIP.findall(ins.html.value)
        assert len(chips) == len(ex), f'row {i}: {len(chips)} chips for {len(ex)} tokens'
        seen = 0  # each chip shows the characters its token adds to the text
        for (s, e), (_, _, shown) in zip(ex.offsets, chips):
            assert html.unescape(shown) == (ex.text[max(s, seen):e].replace('\n', '↵') or '◦')
            seen = max(seen, e)
        full, ranges = oracle_ranges(tok, template, conv['messages'], conv['tools'])
        assert full == ex.text
        in_trained_chip = np.zeros(len(full), dtype=bool)
        for (s, e), (flag, _, _) in zip(ex.offsets, chips):
            if flag == 'y': in_trained_chip[s:e] = True
        for role, s, e in ranges:
            if role == 'assistant':
                assert in_trained_chip[s:e].all(), f'row {i}: assistant text {full[s:e]!r} outside a trained chip'
                n_asst += e - s
            else:
                assert not in_trained_chip[s:e].any(), f'row {i}: {role} text {full[s:e]!r} inside a trained chip'
                n_other += e - s
                inside = [c[1] for (a, b), c in zip(ex.offsets, chips) if s <= a and b <= e and b > a]
                assert set(inside) <= {role}, f'row {i}: {role} tokens drawn with roles {set(inside)}'
    assert n_asst > 50_000 and n_other > 50_000  # the checks above covered a lot of text


def test_expanded_examples_draw_every_earlier_message_in_its_role(tiny_path):
    """Qwen3 (it rewrites earlier turns: rewritten_turns='expand', one example per assistant turn) on the tool-calling sample that
    ships with sft_nb: in every example of every row, the chips of each earlier user and tool message (its content, found
    verbatim and in order in the example's text, not by sft_nb's locator) carry that message's role, never 'template'."""
    from sft_nb.data import load_source, row_dict
    from sft_nb.demo_data import sample_data
    tok = load_tokenizer(str(tiny_path), 'qwen3')
    ins = Inspector(sample_data('glaive_toolcall'), tok, TokenizeConfig(chat_template='qwen3', max_length=None))
    rows, n_later = load_source(sample_data('glaive_toolcall')), 0
    for i in range(len(rows)):
        ins.row.value = i
        msgs = normalize_row(row_dict(rows[i]), 'sharegpt')['messages']
        for k, ex in enumerate(ins.examples):
            chips, cursor = CHIP.findall(example_markup(ex, tok, 'html')), 0
            for j, m in enumerate(msgs):
                c = m['content'].strip()
                if not c or (at := ex.text.find(c, cursor)) < 0: continue  # the example ends before message j
                cursor = at + len(c)
                if m['role'] == 'assistant': continue
                roles = {chip[1] for (a, b), chip in zip(ex.offsets, chips) if at <= a and b <= cursor and b > a}
                assert roles == {m['role']}, f'row {i}, example {k + 1}/{len(ins.examples)}, message {j} ({m["role"]}): roles {roles}'
                n_later += k > 0 and m['role'] == 'tool'
    assert n_later > 20  # tool results before a later example's turn were checked


def test_inspector_controls(shared, qwen, tiny_tok):
    tok, template = qwen
    chats = [{'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]}]
    ins = Inspector({'glaive': shared / 'datasets' / 'glaive_toolcall_en_demo.json', 'mine': chats}, tok, TokenizeConfig(chat_template=template), row=7)
    assert (ins.source.value, ins.row.value) == ('glaive', 7)
    ins.source.value = 'mine'
    assert (ins.row.max, ins.row.value, ins.fmt) == (0, 0, 'messages')
    assert [r for r, _ in zip(ins.example.input_ids, range(3))] == chat_ids(tok, chats[0]['messages'], template=template)[:3]
    assert 'mine row 0 · all_assistant' in ins.html.value
    ins.mode.value = 'all'
    assert ins.example.n_trained == len(ins.example)
    ins.source.value = 'glaive'
    assert ins.row.max == 299 and ins.example.n_trained == len(ins.example)


def test_one_colour_map_for_html_and_ansi(tiny_tok):
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]
    ex = tokenize_conversation(msgs, tiny_tok)
    h, a = example_markup(ex, tiny_tok, 'html'), example_markup(ex, tiny_tok, 'ansi')
    for name in ('trained', 'masked'):
        r, g, b = (int(COLORS[name][k:k + 2], 16) for k in (1, 3, 5))
        assert f'background:{COLORS[name]}' in h and f'\x1b[48;2;{r};{g};{b}m' in a
    for role in ('system', 'user', 'assistant', 'template'):
        r, g, b = (int(ROLE_COLORS[role][k:k + 2], 16) for k in (1, 3, 5))
        assert f'border-color:{ROLE_COLORS[role]}' in h and f'\x1b[38;2;{r};{g};{b}m' in a


def test_inspect_main_prints_ansi(shared, capsys):
    rc = inspect_main(tokenizer_loader=load_tokenizer, argv=[str(shared / 'datasets' / 'glaive_toolcall_en_demo.json'), '--row', '3', '--model', 'tiny', '--mode', 'all_assistant',
                       '--template', str(shared / 'templates' / 'qwen2.5-instruct.jinja')])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith(f'{shared / "datasets" / "glaive_toolcall_en_demo.json"} row 3 · all_assistant · 1293 tokens · 334 trained')
    assert '\x1b[48;2;123;211;137m' in out and '<tool_call>' in re.sub(r'\x1b\[[\d;]*m', '', out)



def test_inspect_main_expanded_examples(shared, capsys):
    "Qwen3 drops earlier reasoning: the CLI prints one example per trained turn (rewritten_turns='expand'), one with 'final'."
    tpl = str(Path(__file__).parent / 'fixtures' / 'templates' / 'qwen3.jinja')
    row = shared / 'datasets' / 'glaive_toolcall_en_demo.json'
    args = [str(row), '--row', '3', '--model', 'tiny', '--template', tpl, '--color', 'never']
    assert inspect_main(tokenizer_loader=load_tokenizer, argv=args) == 0
    out = capsys.readouterr().out
    n = out.count(' · example ')
    assert n > 1 and f'example {n}/{n}' in out
    assert inspect_main(tokenizer_loader=load_tokenizer, argv=args + ['--rewritten-turns', 'final']) == 0
    assert ' · example ' not in capsys.readouterr().out
    assert inspect_main(tokenizer_loader=load_tokenizer, argv=args + ['--no-train-tool-calls']) == 0
    assert '⟦<tool_call>' not in capsys.readouterr().out


def test_inspector_shows_what_trains(shared, qwen, tmp_path):
    """One TokenizeConfig: on a row longer than max_length the inspector shows training's verdict ('drop': dropped as too long;
    'keep_start': the same cut ids and mask as the tokenized dataset), and {'tools': [...]} in its template kwargs renders."""
    tok, template = qwen
    path = shared / 'datasets' / 'glaive_toolcall_en_demo.json'
    full = Inspector(path, tok, TokenizeConfig(chat_template=template), row=3).example
    for truncation in ('drop', 'keep_start'):
        cfg = TokenizeConfig(chat_template=template, max_length=len(full) - 7, truncation=truncation)
        ins = Inspector(path, tok, cfg, row=3)
        assert ins.max_length.value == cfg.max_length and ins.spec == cfg  # the controls start from the config, nothing else
        ds, rep = tokenize_dataset(path, tok, cfg, cache_dir=str(tmp_path))
        trained = {int(i): k for k, i in enumerate(ds['index'])}
        if truncation == 'drop':
            assert ins.example is None and ins.error == f'too_long: {len(full)} tokens > max_length {len(full) - 7}'
            assert 3 not in trained and any(b[0] == 3 and b[1] == 'too_long' for b in rep.bad_rows)
            assert 'not trained — too_long' in ins.html.value
        else:
            assert ins.example.truncated and 'truncated: yes' in ins.html.value
            assert (ins.example.input_ids, ins.example.loss_mask) == (ds[trained[3]]['input_ids'], ds[trained[3]]['loss_mask'])
    tools = [{'type': 'function', 'function': {'name': 'qzx_lookup', 'description': 'd', 'parameters': {'type': 'object', 'properties': {}}}}]
    chats = [{'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]}]
    ins = Inspector({'chat': chats}, tok, TokenizeConfig(chat_template=template))
    ins.kwargs.value = json.dumps({'tools': tools})
    assert ins.error == '' and 'qzx_lookup' in ins.example.text  # a row without tools gets the kwargs' tools, as in training
    ds, _ = tokenize_dataset(chats, tok, TokenizeConfig(chat_template=template, chat_template_kwargs={'tools': tools}), use_cache=False)
    assert ds[0]['input_ids'] == ins.example.input_ids


def test_named_template_trains_what_the_inspector_shows(tiny_path, tmp_path):
    """A shipped template's name brings its family's special tokens to the trainer's tokenizer (`load_model_inputs`) as to the
    inspector's (`load_tokenizer`): the trainer's data plan with chat_template='llama3' trains the ids the inspector shows,
    on a model whose embedding has rows for Llama 3's four header/turn tokens; where it has none, setup refuses by name."""
    import shutil
    from sft_nb.models import load_model_inputs
    from sft_nb.trainer import SFTTrainer
    from sft_nb.config import ConfigError
    roomy = tmp_path / 'roomy'; roomy.mkdir()  # the tiny tokenizer with a 1024-row embedding (712 tokens): room for added ones
    for f in Path(tiny_path).iterdir():
        if 'token' in f.name or f.name == 'config.json': shutil.copy(f, roomy / f.name)
    cfg = json.loads((roomy / 'config.json').read_text()); cfg['vocab_size'] = 1024; (roomy / 'config.json').write_text(json.dumps(cfg))
    data = str(Path(__file__).parent / 'fixtures' / 'reasoning.jsonl')
    t = SFTTrainer({'model': {'path': str(roomy)}, 'tokenize': {'chat_template': 'llama3'}, 'data': {'train': [{'path': data}]},
                    'checkpoint': {'run_dir': str(tmp_path / 'run')}})
    t.tokenizer, t.processor = load_model_inputs(t.cfg.model.path, t.cfg.tokenize.chat_template); t._prepare_data()
    tok = load_tokenizer(str(roomy), 'llama3')
    header = tok.convert_tokens_to_ids('<|start_header_id|>')
    assert header >= 712 and t.tokenizer.convert_tokens_to_ids('<|start_header_id|>') == header
    ds = t.data.train_sets[0]
    ins = Inspector(data, tok, t.cfg.tokenize)
    for k in range(len(ds)):
        ins.row.value = int(ds[k]['index'])
        assert (ins.example.input_ids, ins.example.loss_mask) == (ds[k]['input_ids'], ds[k]['loss_mask']), k
    assert header in ds[0]['input_ids']  # one token, as the inspector shows it, not its bytes
    t2 = SFTTrainer({'model': {'path': str(tiny_path)}, 'tokenize': {'chat_template': 'llama3'}, 'data': {'train': [{'path': data}]},
                     'checkpoint': {'run_dir': str(tmp_path / 'run2')}})
    with pytest.raises(ConfigError, match=r"'llama3' needs special tokens the model .* lacks .*embedding has 712 rows"): t2.setup()
    assert t2.group is None


def test_inspector_history_controls(tiny_tok):
    tpl = (Path(__file__).parent / 'fixtures' / 'templates' / 'qwen3.jinja').read_text()
    conv = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!', 'reasoning_content': 'A greeting.'},
            {'role': 'user', 'content': 'Bye'}, {'role': 'assistant', 'content': 'Bye now.', 'reasoning_content': 'A farewell.'}]
    ins = Inspector({'chat': [{'messages': conv}]}, tiny_tok, TokenizeConfig(chat_template=tpl))
    assert ins.kwargs.style.description_width == 'initial'  # the label is not cut to 'template …' in a browser
    assert len(ins.examples) == 2 and 'example 2/2' in ins.html.value
    ins.rewritten_turns.value = 'error'
    assert ins.examples == [] and "rewritten_turns='expand'" in ins.error
    ins.mode.value = 'last_assistant'
    assert len(ins.examples) == 1 and 'A farewell.' in ins.example.text

# which checks each real template fails, on the first 20 glaive rows plus two plain chats
EXPECTED_FAILS = {  # 'unrendered': glaive's tool schemas and tool_calls reach no template here but Qwen2.5's
    'chatml': {'renders', 'unrendered'},
    'llama-3-instruct': {'renders', 'unrendered'},
    'mistral-instruct': {'renders', 'unrendered'},
    'gemma-it': {'renders', 'unrendered'},
    'phi-3': {'renders', 'unrendered'},
    'qwen2.5-instruct': {'default_system_prompt'},
    'smollm2': {'default_system_prompt', 'empty_trained_span', 'unrendered'},
}
MULTI = [{'role': 'user', 'content': 'Hi there, who are you?'}, {'role': 'assistant', 'content': 'I am a tiny model.'},
         {'role': 'user', 'content': 'What is 2 + 2?'}, {'role': 'assistant', 'content': '  It is 4.\n'}]
SYSTEM = [{'role': 'system', 'content': 'You answer briefly.'}] + MULTI


@pytest.fixture(scope='module')
def lint_samples(glaive):
    return glaive[:20] + [MULTI, SYSTEM]


@pytest.mark.parametrize('family', list(FAMILY_SPECIALS))
def test_lint_real_templates(family, tiny_path, shared, lint_samples):
    tok = add_family_specials(AutoTokenizer.from_pretrained(tiny_path), family)
    if family == 'smollm2': template = smollm2_chat_template()
    else:
        template = (shared / 'templates' / f'{family}.jinja').read_text()
        if family != 'qwen2.5-instruct': template = collapse_template(template)
    lint = lint_template(tok, lint_samples, template)
    assert list(lint.check) == list(CHECKS) and set(lint.status) <= {'pass', 'info', 'fail', 'n/a'}
    assert failed(lint) == EXPECTED_FAILS[family]
    r = lint.set_index('check')
    assert (r.example[r.status == 'fail'] != '').all()  # every failure shows an offending example
    if family == 'qwen2.5-instruct':
        assert r.loc['default_system_prompt', 'example'] == 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.'
    if family == 'smollm2':
        assert r.loc['default_system_prompt', 'example'] == 'You are a helpful AI assistant named SmolLM, trained by Hugging Face'
        assert r.loc['empty_trained_span', 'example'] == "message 3 trains only '<|im_end|>': its tool_calls are not rendered"
    if family == 'chatml':
        assert r.loc['text_after_eot', 'status'] == 'info' and r.loc['text_after_eot', 'example'].startswith("'<|im_end|>' is followed by '\\n': never trained")
        assert r.loc['renders', 'example'].startswith('8 of 22 samples refused; first: TemplateError: chat template given in tokenize.chat_template')
        assert 'Conversation roles must alternate' in r.loc['renders', 'example']
        assert 'tool_calls (sample 0): not rendered' in r.loc['unrendered', 'example'] and 'tokenize.chat_template=qwen2.5 or tokenize.chat_template=qwen3' in r.loc['unrendered', 'example']


def test_lint_smollm2_real_tokenizer(lint_samples):
    "SmolLM2's own BPE merges '\\n' with following spaces: an answer starting with spaces straddles the header."
    from sft_nb.models import smollm2_instruct
    tok = AutoTokenizer.from_pretrained(smollm2_instruct())
    lint = lint_template(tok, lint_samples, smollm2_chat_template())
    assert failed(lint) == {'default_system_prompt', 'empty_trained_span', 'whitespace_merged', 'unrendered'}
    assert lint.set_index('check').loc['whitespace_merged', 'sample'] == 20  # MULTI: '  It is 4.'



def test_lint_verdicts_match_training(glaive):
    "The recommended templates on the shipped examples' data (the identity demo; qwen3 also on the glaive tool calls and the "
    "tool-call and reasoning fixtures): no `fail`; what the masks or `rewritten_turns='expand'` handle is `info`, saying how. ChatML "
    "on tool calls it does not render: still `fail`."
    from sft_nb.demo_data import identity_rows
    from sft_nb.data import load_source, row_dict
    demo = identity_rows()['train'][:20]
    fixtures = Path(__file__).parent / 'fixtures'
    fix = [row_dict(r) for f in ('tool_calls.jsonl', 'reasoning.jsonl') for r in load_source(str(fixtures / f)).select(range(10))]
    for name, rows in (('chatml', demo), ('qwen3', demo + glaive[:20] + fix)):
        lint = lint_template(load_tokenizer('tiny', name), rows, name)
        assert failed(lint) == set(), (name, lint[lint.status == 'fail'])
        r = lint.set_index('check')
        assert r.loc['text_after_eot', 'status'] == 'info' and 'never trained' in r.loc['text_after_eot', 'example']
    assert r.loc['rewrites_history', 'status'] == 'info' and "rewritten_turns='expand'" in r.loc['rewrites_history', 'example']  # qwen3
    assert 'unrendered' in failed(lint_template(load_tokenizer('tiny', 'chatml'), glaive[:20], 'chatml'))  # tool calls never reach the tokens


def test_batch_heatmap(qwen, glaive):
    tok, template = qwen
    exs = [tokenize_conversation(normalize_row(r, 'sharegpt')['messages'], tok, tools=normalize_row(r, 'sharegpt')['tools'], template=template)
           for r in glaive[:5]]
    padded, packed = collate_padded(exs, tok.pad_token_id), collate_packed([exs[:2], exs[2:]], tok.pad_token_id)
    for batch, rows in ((padded, [[e] for e in exs]), (packed, [exs[:2], exs[2:]])):
        width = len(batch['labels'][0])
        want = []  # from the examples alone: each sequence's tokens trained where its loss mask says (never its first), then padding
        for seqs in rows:
            row = [TRAINED if m and t > 0 else MASKED for e in seqs for t, m in enumerate(e.loss_mask)]
            want.append(row + [PAD] * (width - len(row)))
        assert [list(r) for r in batch_fig(batch).data[0].z] == want
        grid, starts = batch_grid(batch)
        assert int((grid == TRAINED).sum()) == batch['n_trained']
    fig = batch_fig(packed)
    assert len(fig.layout.shapes) == 2 * 3  # (2 + 3 sequences) - 2 rows = 3 boundaries, drawn on both panels
    assert [s.x0 for s in fig.layout.shapes[::2]] == [len(exs[0]) - .5, len(exs[2]) - .5, len(exs[2]) + len(exs[3]) - .5]
    assert fig.data[1].z[0][len(exs[0])] == 0  # position ids restart at the boundary


def test_dataset_report(shared, qwen, tmp_path):
    tok, template = qwen
    rep = dataset_report(shared / 'datasets' / 'glaive_toolcall_en_demo.json', tok, TokenizeConfig(max_length=1024, chat_template=template),
                         cache_dir=str(tmp_path))
    assert rep.report.n_rows == 300 and rep.report.n_dropped == int(rep.drops.rows.sum()) > 0
    assert len(rep.fig.data[2].x) == rep.report.dropped['too_long']
    assert min(rep.fig.data[2].x) > 1024 >= max(rep.fig.data[0].x)
    assert rep.fig.layout.shapes[0].x0 == 1024
    assert 'marks max_length 1024' in rep.text()
    assert list(rep.dropped.columns) == ['row', 'reason', 'message'] and len(rep.dropped) == 5


@pytest.fixture(scope='module')
def executed_example(tmp_path_factory):
    "examples/inspect.ipynb run headless with papermill: tiny model, glaive data, Qwen2.5 template."
    out = tmp_path_factory.mktemp('example')
    return screenshot_tool().execute_example(out / 'inspect.ipynb', cache_dir=str(out / 'cache'))


def test_example_notebook_runs_with_papermill(executed_example, shared):
    nb = json.loads(executed_example.read_text())
    tags = [c['metadata'].get('tags', []) for c in nb['cells']]
    assert ['parameters'] in tags and ['injected-parameters'] in tags
    injected = ''.join(nb['cells'][tags.index(['injected-parameters'])]['source'])
    assert "qwen2.5-instruct.jinja" in injected and "model = \"tiny\"" in injected
    outputs = [o for c in nb['cells'] if c['cell_type'] == 'code' for o in c['outputs']]
    assert not [o for o in outputs if o['output_type'] == 'error']
    htmls = ''.join(''.join(o.get('data', {}).get('text/html', '')) for o in outputs)
    texts = ''.join(''.join(o.get('text', '')) for o in outputs)
    assert 'glaive_toolcall_en_demo.json row 3 · all_assistant · 1293 tokens · 334 trained' in htmls
    assert '<span class="k y r-assistant"' in htmls  # trained assistant chips
    assert 'default_system_prompt' in htmls  # the lint table
    assert '300 rows:' in texts and 'packed: 2 rows' in texts
    assert any('application/vnd.plotly.v1+json' in o.get('data', {}) for o in outputs)


def test_screenshot_shows_coloured_chips(executed_example):
    "The executed example → nbconvert page → headless Chromium screenshot → the chip colours are on it."
    shot = screenshot_tool()
    chromium, why = shot.ensure_chromium(install=True)
    if chromium is None: pytest.skip(f'no headless browser: {why}')
    page = shot.to_html(executed_example)
    png = shot.screenshot(chromium, page, executed_example.with_name('inspector.png'))
    counts = shot.chip_pixels(png)
    assert counts['trained'] > 2000 and counts['masked'] > 2000, counts
