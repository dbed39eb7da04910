"""Formats people export: LLaMA-Factory v1 content parts, OpenAI `reasoning_content` + `tool_calls`, OpenAI
responses items, per-message `loss_weight`; an unknown part type is a bad row that names it; after a failure the report
says per row why.

Shapes of the fixtures in tests/fixtures/formats/ (facts, not code): LLaMA-Factory v1 `src/llamafactory/v1/extras/types.py`
(`Content = {type: text|reasoning|tool_call|..., value: str}`, `Message = {role, content: list[Content], loss_weight}`) and
its `plugins/data_plugins/converter.py` (a tool call's value is `json.dumps({name, arguments})`, `tools` a JSON string on
the row, `loss_weight` 0.0 on user/system turns); OpenAI responses items `reasoning` (with `summary` of `summary_text`),
`function_call` (`call_id`, `name`, `arguments` as a JSON string), `function_call_output` (`output`).
"""
import json
from types import SimpleNamespace
from pathlib import Path
import pytest
from helpers import run_cfg, trained_runs
from sft_nb.config import ConfigError
from sft_nb.formats import BadRow, normalize_row
from sft_nb.data import load_source, row_dict
from sft_nb.config import TokenizeConfig
from sft_nb.tokenize import tokenize_dataset

FIX = Path(__file__).parent / 'fixtures' / 'formats'
rows = lambda name: [json.loads(l) for l in (FIX / name).read_text().splitlines()]
WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Paris'}}}


def test_llamafactory_v1_rows_keep_their_content():
    "Text parts under `value`, reasoning parts → reasoning_content, tool_call parts → tool_calls, loss_weight 0 → untrained."
    convs = [normalize_row(r, 'messages') for r in rows('llamafactory_v1.jsonl')]
    assert convs[0]['messages'] == [{'role': 'system', 'content': 'You are terse.', 'train': False},
                                    {'role': 'user', 'content': 'What is 2 + 2?', 'train': False},
                                    {'role': 'assistant', 'content': '4.'}]
    call = convs[1]['messages'][1]
    assert call == {'role': 'assistant', 'content': '', 'tool_calls': [WEATHER], 'reasoning_content': 'The user wants the weather; call the tool.'}
    assert convs[1]['messages'][3]['reasoning_content'] == '18 C is mild.' and convs[1]['messages'][3]['content'] == '18 degrees and mild.'
    assert convs[1]['tools'][0]['function']['name'] == 'get_weather'
    assert convs[2]['messages'][1]['train'] is False and convs[2]['messages'][3]['loss_weight'] == 0.5


def test_openai_shapes():
    oa = [normalize_row(r, 'messages') for r in rows('openai_reasoning_tools.jsonl')]
    assert oa[0]['messages'][1] == {'role': 'assistant', 'content': '', 'reasoning_content': 'I should look it up.',
                                    'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Oslo'}}, 'id': 'call_1'}]}
    assert oa[1]['messages'][0]['content'] == 'Name a prime.'
    rs = normalize_row(rows('openai_responses.jsonl')[0], 'messages')['messages']
    assert [m['role'] for m in rs] == ['user', 'assistant', 'tool', 'assistant']
    assert rs[1] == {'role': 'assistant', 'content': '', 'reasoning_content': 'Call the weather tool.',
                     'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Rome'}}, 'id': 'fc_1'}]}
    assert rs[2]['content'] == '{"temp_c": 25}' and rs[3]['content'] == '25 degrees: warm.'


def test_unknown_part_is_a_bad_row_naming_the_type():
    with pytest.raises(BadRow) as e: normalize_row(rows('unknown_part.jsonl')[0], 'messages')
    msg = str(e.value)
    assert "message 1: content parts of type ['citation'] are not read" in msg and 'LLaMA-Factory v1' in msg and 'OpenAI responses' in msg
    assert 'vision-language' not in msg  # the misleading hint is for image parts only


@pytest.mark.parametrize('name', ['llamafactory_v1.jsonl', 'openai_reasoning_tools.jsonl', 'openai_responses.jsonl'])
def test_every_row_trains_its_answers(name, tiny_tok, tmp_path):
    "Tokenized with the tiny ChatML model: every row kept, the assistant text of trained turns in the trained tokens."
    ds, rep = tokenize_dataset(FIX / name, tiny_tok, TokenizeConfig(max_length=512), cache_dir=str(tmp_path))
    assert rep.n_kept == rep.n_rows == len(rows(name)) and not rep.bad_rows
    for k in range(len(ds)):
        conv = normalize_row(rows(name)[int(ds[k]['index'])], 'messages')
        answers = [m['content'] for m in conv['messages'] if m['role'] == 'assistant' and m.get('train', True) and m['content']]
        trained = ''.join(trained_runs(SimpleNamespace(**ds[k]), tiny_tok))
        for a in answers: assert a in trained, (name, k, a, trained)


def test_failed_setup_leaves_a_report(tiny_path, tmp_path):
    "'no usable rows': the error and `trainer.data_report` say per row why (tokenization runs before Ray starts)."
    from sft_nb.trainer import SFTTrainer
    cfg = run_cfg(tiny_path, tmp_path / 'run', data__train=[{'path': str(FIX / 'unknown_part.jsonl')}], tokenize__cache_dir=str(tmp_path / 'c'))
    t = SFTTrainer(cfg)
    with pytest.raises(ConfigError, match="no usable rows after tokenization: 1 of 1 rows dropped.*row 0: bad_format: message 1: content parts of type"):
        t.setup()
    assert t.data_report is not None and t.data_report.n_rows == 1 and t.data_report.n_kept == 0
    assert t.data_report.bad_rows[0][:2] == (0, 'bad_format') and "['citation']" in t.data_report.bad_rows[0][2]


def test_dropped_reasoning_is_reported(tiny_tok, tmp_path):
    "The tiny ChatML has no place for reasoning_content, tool_calls or tool schemas: the report says so and names the shipped template that keeps them."
    _, rep = tokenize_dataset(FIX / 'llamafactory_v1.jsonl', tiny_tok, TokenizeConfig(max_length=512), cache_dir=str(tmp_path))
    assert rep.lost == {'reasoning': 2, 'tool_calls': 1, 'tools': 1} and rep.lost_rows == [1]
    assert "1 examples come with tool schemas (tools) the chat template does not render: the model never sees them (row 1); " \
           "a template that renders it: tokenize.chat_template=qwen2.5 or tokenize.chat_template=qwen3" in str(rep)
    assert "2 trained assistant turns carry reasoning_content the chat template does not render: it never reaches the tokens (row 1); " \
           "a template that renders it: tokenize.chat_template=qwen3" in str(rep)
    assert 'tool_calls the chat template does not render' in str(rep) and 'tokenize.chat_template=qwen2.5 or tokenize.chat_template=qwen3' in str(rep)
    from sft_nb.cli import in_parameter_words, parameter_keys  # in a notebook: its `template` parameter, as Python
    said = in_parameter_words(str(rep), parameter_keys(Path(__file__).parents[1] / 'examples' / 'inspect.ipynb'))
    assert "a template that renders it: template='qwen2.5' or template='qwen3'" in said and 'tokenize.' not in said
    _, rep3 = tokenize_dataset(FIX / 'llamafactory_v1.jsonl', tiny_tok, TokenizeConfig(max_length=512, chat_template='qwen3'), cache_dir=str(tmp_path))
    assert rep3.lost == {} and rep3.n_kept == 3 and 'WARNING' not in str(rep3)
    assert rep3.n_trained > rep.n_trained  # the reasoning and the call are trained now


def test_inspect_example_runs_all_on_unreadable_rows(tmp_path):
    "examples/inspect.ipynb on a file whose only row cannot be read, with a shipped template by name: every cell runs; the lint reports the row."
    import importlib.util
    spec = importlib.util.spec_from_file_location('sft_nb_screenshot', Path(__file__).resolve().parents[1] / 'tools' / 'screenshot.py')
    shot = importlib.util.module_from_spec(spec); spec.loader.exec_module(shot)
    out = shot.execute_example(tmp_path / 'inspect.ipynb', data=str(FIX / 'unknown_part.jsonl'), template='qwen3', row=0, cache_dir=str(tmp_path / 'c'))
    nb = json.loads(out.read_text())
    outputs = [o for c in nb['cells'] if c['cell_type'] == 'code' for o in c['outputs']]
    assert not [o for o in outputs if o['output_type'] == 'error']
    texts = ''.join(''.join(o.get('text', '')) for o in outputs) + ''.join(''.join(o.get('data', {}).get('text/plain', '')) for o in outputs)
    htmls = ''.join(''.join(o.get('data', {}).get('text/html', '')) for o in outputs)
    assert 'not trained — bad_format: message 1: content parts of type' in htmls  # the inspector (HTML-escaped)
    assert "bad_format: message 1: content parts of type ['citation'] are not read" in texts  # the printed row
    assert '1 of 1 samples not read; first: sample 0' in htmls  # the lint's 'reads' check (pandas cuts long cells)
    assert 'no row of' in texts and 'survived tokenization' in texts


def test_anthropic_messages(tiny_path, tmp_path):
    """Anthropic Messages shapes (facts from its API docs: content blocks `text`, `thinking` {thinking, signature}, `tool_use`
    {id, name, input}; tool results as `tool_result` {tool_use_id, content: string or text blocks} blocks of a *user* message;
    tools {name, description, input_schema}; `system` at the top level): the calls and the reasoning reach Qwen3's tokens and
    are trained, each tool result is a tool turn (rendered as <tool_response>, never trained as the user's words), and the
    trainer's data plan trains what the inspector shows. A user message mixing tool results with text is a bad row saying so."""
    from sft_nb.inspect import Inspector
    from sft_nb.models import load_model_inputs, load_tokenizer
    from sft_nb.trainer import SFTTrainer
    conv = normalize_row(rows('anthropic_messages.jsonl')[0], 'messages')
    assert [m['role'] for m in conv['messages']] == ['system', 'user', 'assistant', 'tool', 'tool', 'assistant']
    call = conv['messages'][2]
    assert call['reasoning_content'] == 'Two cities: call the tool for both.' and call['content'] == 'Let me check both.'
    assert [(c['id'], c['function']['arguments']) for c in call['tool_calls']] == [('toolu_01', {'city': 'Rome'}), ('toolu_02', {'city': 'Oslo'})]
    assert [(m['tool_call_id'], m['content']) for m in conv['messages'][3:5]] == [('toolu_01', '21 C'), ('toolu_02', '9 C')]
    assert conv['tools'][0]['function']['parameters']['required'] == ['city']  # input_schema is the schema templates render
    path = FIX / 'anthropic_messages.jsonl'
    t = SFTTrainer({'model': {'path': str(tiny_path)}, 'tokenize': {'chat_template': 'qwen3', 'max_length': 1024},
                    'data': {'train': [{'path': str(path)}]}, 'checkpoint': {'run_dir': str(tmp_path / 'run')}})
    t.tokenizer, t.processor = load_model_inputs(t.cfg.model.path, t.cfg.tokenize.chat_template); t._prepare_data()
    rep, ds = t.data.data_report, t.data.train_sets[0]
    assert rep.n_kept == 2 and rep.bad_rows[0][0] == 2 and "message 0: a user message mixes tool_result parts with ['text'] parts" in rep.bad_rows[0][2]
    ins = Inspector(str(path), load_tokenizer(str(tiny_path), 'qwen3'), t.cfg.tokenize)
    trains = {}
    for k in range(len(ds)): trains.setdefault(int(ds[k]['index']), []).append((ds[k]['input_ids'], ds[k]['loss_mask']))
    assert sorted(trains) == [0, 1] and len(trains[0]) == 2  # Qwen3 drops earlier turns' reasoning: row 0 is two examples
    for i, want in trains.items():
        ins.row.value = i
        assert [(e.input_ids, e.loss_mask) for e in ins.examples] == want, i
    ins.row.value = 0
    calls, answer = (''.join(trained_runs(e, t.tokenizer)) for e in ins.examples)  # each example trains one turn
    assert 'Two cities: call the tool for both.' in calls and '"city": "Oslo"' in calls and 'Rome is warmer.' in answer
    assert '<tool_response>\n9 C\n</tool_response>' in ins.examples[1].text and '9 C\n' not in answer  # the tool's words: context only


def test_template_error_names_what_the_template_lacks(shared, tmp_path):
    """Llama 3's public template raises "roles must alternate" on glaive's tool turns: the report and the inspector both add that
    the row has tool turns and calls it renders nothing of, and which shipped template does; rows with tool schemas it drops are
    a warning, not silence."""
    from sft_nb.inspect import Inspector
    from sft_nb.models import load_tokenizer
    tpl = str(shared / 'templates' / 'llama-3-instruct.jinja')
    path = shared / 'datasets' / 'glaive_toolcall_en_demo.json'
    tok = load_tokenizer('tiny', tpl)
    cfg = TokenizeConfig(chat_template=tpl, max_length=4096)
    _, rep = tokenize_dataset(path, tok, cfg, cache_dir=str(tmp_path))
    tail = ("Conversation roles must alternate user/assistant/user/assistant/... (the row has tool, tool_calls, tools, "
            "which this template renders nothing of; a template that does: tokenize.chat_template=qwen2.5 or tokenize.chat_template=qwen3)")
    row, reason, why = rep.bad_rows[0]
    assert (row, reason) == (0, 'template_error') and why.startswith('chat template error: chat template given in tokenize.chat_template') and why.endswith(tail)
    assert Inspector(str(path), tok, cfg, row=0).error == f'template_error: {why}'
    assert rep.lost.get('tools', 0) > 0 and 'tool schemas (tools) the chat template does not render' in str(rep)


def test_an_alpaca_row_with_history_trains_every_answer(tiny_tok):
    "Alpaca's `history` ([question, answer] pairs before the instruction) becomes earlier turns: every answer is trained, no question is."
    from sft_nb.renderers import tokenize_conversation
    row = {'instruction': 'And 3 plus 3?', 'input': '', 'output': 'It is 6.', 'system': 'Be brief.',
           'history': [['What is 1 plus 1?', 'It is 2.'], ['And 2 plus 2?', 'It is 4.']]}
    msgs = normalize_row(row, 'alpaca')['messages']
    assert [(m['role'], m['content']) for m in msgs] == [('system', 'Be brief.'), ('user', 'What is 1 plus 1?'), ('assistant', 'It is 2.'),
                                                       ('user', 'And 2 plus 2?'), ('assistant', 'It is 4.'),
                                                       ('user', 'And 3 plus 3?'), ('assistant', 'It is 6.')]
    ex = tokenize_conversation(msgs, tiny_tok)
    trained = ''.join(trained_runs(ex, tiny_tok))
    assert all(a in trained for a in ('It is 2.', 'It is 4.', 'It is 6.')) and 'plus' not in trained and 'brief' not in trained, trained
