"""A template may allocate `'a' * 10**8`, on every path a chat template is rendered by: the probe and the prefix
renders (`template_info`), the `{% generation %}` mask path, a whole tokenization, the lint, the generation prompt of
`trainer.chat`/`generate` (`chat_ids`) and the vision processor's placeholder. Each payload (a huge value, a loop or a
recursion without end, a sandbox escape) must be a `TemplateError` naming the template: never a hang, a MemoryError, a
crash or a silent success (Jinja renders an unsafe attribute as '')."""
import pytest
from sft_nb.templates import TemplateError, TemplateRenderer, chat_ids, render, shipped_template, template_info
from sft_nb.renderers import tokenize_conversation
from sft_nb.lint import lint_template

CONV = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]

PAYLOADS = {
    'str_times': "{{ 'a' * 10**9 }}",
    'range': "{% for i in range(10**9) %}x{% endfor %}",
    'nested_loops': "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",  # 10^10 empty iterations
    'mro': "{{ ''.__class__.__mro__ }}",
    'cycler_globals': "{{ cycler.__init__.__globals__.os }}",
    'joiner_globals': "{% set j = joiner(',') %}{{ j.__call__.__globals__ }}",
    'format_escape': "{{ '{0.__class__.__base__.__subclasses__}'.format('') }}",
    'namespace_dunder': "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}{{ ns.a }}",
    'self_globals': "{{ self.__init__.__globals__ }}",
    'recursion': "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
    'exp_macro': "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",  # 2^60 calls
    'raw_doubling': "{% raw %}x{% endraw %}{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    'replace_bomb': "{% set s = 'a' * 10**6 %}{{ s|replace('a', s) }}",
    'join_bomb': "{{ range(100000)|join('a' * 1000) }}",
    'star_width': "{{ '%*s' % (10**9, 'a') }}",
    'nested_format_width': "{{ '{:{}}'.format('a', 10**9) }}",
    'lipsum': "{{ lipsum(10**9) }}",
    'tojson_indent': "{{ messages|tojson(indent=10**9) }}",
    'include': "{% include 'other.jinja' %}",  # Jinja: TypeError 'no loader for this environment specified'
}


def _tagged(payload):
    "The shipped ChatML template with the payload inside its `{% generation %}` block."
    t = shipped_template('chatml')
    return t.replace('{% generation %}', '{% generation %}' + payload, 1)


def _expect(call):
    with pytest.raises(TemplateError, match=r"chat template given in tokenize\.chat_template \("):
        call()


@pytest.fixture(autouse=True)
def short_time_bound(request, monkeypatch):
    """The time bound (`MAX_TEMPLATE_SECONDS`, 5 s) is what stops `exp_macro`: the render path shows it as shipped; every
    other path and the lint show that they are bounded by it, at 0.5 s."""
    if 'exp_macro' in request.node.name and request.node.name != 'test_every_render_path_bounds_the_template[render-exp_macro]':
        monkeypatch.setattr('sft_nb.templates.MAX_TEMPLATE_SECONDS', 0.5)


@pytest.fixture(scope='module')
def proc():
    from sft_nb.vlm_models import load_processor
    from sft_nb.models import resolve_model_path
    return load_processor(resolve_model_path('tiny-vlm'))


PATHS = {
    'probe': lambda tok, p: template_info(tok, p),
    'render': lambda tok, p: render(tok, CONV, template=p),
    'tags': lambda tok, p: TemplateRenderer(tok, _tagged(p))(CONV, tags=True),
    'tokenize_tagged': lambda tok, p: tokenize_conversation(CONV, tok, template=_tagged(p)),
    'chat_ids': lambda tok, p: chat_ids(tok, CONV[:1], template=p, add_generation_prompt=True),
}


@pytest.mark.parametrize('payload', PAYLOADS, ids=list(PAYLOADS))
@pytest.mark.parametrize('path', PATHS, ids=list(PATHS))
def test_every_render_path_bounds_the_template(tiny_tok, path, payload):
    _expect(lambda: PATHS[path](tiny_tok, PAYLOADS[payload]))


@pytest.mark.parametrize('payload', PAYLOADS, ids=list(PAYLOADS))
def test_lint_names_the_template(tiny_tok, payload):
    "The lint reports the probe's refusal as a failed `renders` check (or raises it): never a pass, never a hang."
    try: df = lint_template(tiny_tok, [{'messages': CONV}], PAYLOADS[payload])
    except TemplateError as e: assert 'chat template given in tokenize.chat_template (' in str(e); return
    row = df.set_index('check').loc['renders']
    assert row.status == 'fail' and 'chat template given in tokenize.chat_template (' in str(row.example)


def test_lint_does_not_read_a_bound_as_refusing_system(tiny_tok):
    "A payload only in the system branch is a TemplateError naming the bound, never read as 'refuses system messages'."
    t = "{% if messages[0].role == 'system' %}{{ 'a' * 10**9 }}{% endif %}" + tiny_tok.chat_template
    with pytest.raises(TemplateError, match="'\\*' would make 1,000,000,000 characters"):
        lint_template(tiny_tok, [{'messages': CONV}], t)


@pytest.mark.parametrize('payload', ['str_times', 'mro', 'exp_macro', 'join_bomb'])
def test_vision_placeholder_is_bounded(proc, payload):
    from sft_nb.vision import image_placeholder
    _expect(lambda: image_placeholder(proc, PAYLOADS[payload]))


def test_errors_name_the_tokenizers_and_shipped_templates(tiny_tok):
    tiny_tok_copy = type(tiny_tok).from_pretrained(tiny_tok.name_or_path)
    tiny_tok_copy.chat_template = "{{ ''.__class__ }}"
    with pytest.raises(TemplateError, match=f"chat template of '{tiny_tok.name_or_path}'"):
        render(tiny_tok_copy, CONV)
    assert chat_ids(tiny_tok, CONV) == list(tiny_tok.apply_chat_template(CONV)['input_ids'])  # a real template still renders as transformers does
