"""A user's mistake in a real JupyterLab + headless Chromium (the session's server and browser, tests/jupyter_lab.py):
`examples/interactive.ipynb` and `examples/inspect.ipynb` with a missing data file, an unknown template and
`max_length=8` show one short box naming the problem and the fix (`sft_nb.errors`), no traceback line visible until its
fold is clicked. One kernel per notebook: Run All stops at the first mistake; each next mistake is set in a new cell and
the cell that reads it is run again. Screenshots: build/browser/error_*.png."""
from __future__ import annotations
import re
import pytest
from jupyter_lab import LAB_DIR, Notebook, code_cell, rerun, with_params
from sft_nb.lint import CHECKS

pytestmark = pytest.mark.timeout(900)
TB = 'Traceback (most recent call last)'
BOX = '#ffdddd'  # an error output's background (JupyterLab's --jp-rendermime-error-background)


def _run_menu(nb, command: str):
    nb.page.locator('.lm-MenuBar-item', has_text=re.compile(r'^Run$')).click()
    nb.page.locator(f'.lm-Menu-item[data-command="{command}"]').click()


def _check_box(nb, cell, kind: str, what: str, fix: str, shot: str) -> str:
    "Wait for `cell`'s box of `kind`; it names `what` and `fix` in at most 3 lines, and no traceback line shows until the fold opens."
    box = nb.user_errors(cell)
    nb.see(box.filter(has_text=f'{kind}: '))
    text = box.inner_text()
    assert box.count() == 1 and text.startswith(f'{kind}: ') and what in text and fix in text, text
    assert len(text.strip().splitlines()) <= 3 and TB not in text and 'File "' not in text, text
    outputs = cell.locator('.jp-OutputArea')
    assert TB not in outputs.inner_text() and nb.errors_shown(cell).count() == 1  # the fold is closed: nothing of it but its summary
    cell.scroll_into_view_if_needed(); nb.shot(shot, cell, (BOX,))
    return text


def test_mistakes_in_interactive_show_one_box(lab, browser):
    "A misspelled parameter (num_step), then a missing file, an unknown template and max_length=8, each fixed in a new cell."
    name = with_params('interactive.ipynb', 'interactive_errors.ipynb', {'train_data': "'nope.jsonl'"})
    f = LAB_DIR / name
    f.write_text(f.read_text().replace('num_steps = 150', 'num_step = 20', 1))  # the typo a user makes in the parameters cell
    nb = Notebook(browser, lab, name)
    try:
        _run_menu(nb, 'runmenu:run-all')
        setup = code_cell(nb, 'trainer.setup()')
        _check_box(nb, setup, 'ParameterError', 'num_step: not a parameter of this notebook; did you mean num_steps?',
                   "fix: rename it in the parameters cell", 'error_interactive_typo')
        nb.run_new_cell('num_steps = 20')
        rerun(nb, setup)
        _check_box(nb, setup, 'MissingFile', "data source 'nope.jsonl' does not exist", 'fix: check the path', 'error_interactive_missing')
        setup.locator('.sft-nb-error-tb summary').click()  # one click opens the traceback
        assert TB in setup.locator('.jp-OutputArea').inner_text()
        nb.shot('error_interactive_missing_open', setup, (BOX,))

        nb.run_new_cell("train_data, template = '', 'qwen4'")
        rerun(nb, setup)
        _check_box(nb, setup, 'TemplateError', "TemplateError: template: 'qwen4' names no file", "fix: did you mean 'qwen3'?", 'error_interactive_template')

        nb.run_new_cell("template, max_length = '', 8")
        rerun(nb, setup)
        text = _check_box(nb, setup, 'ConfigError', 'data.train: no usable rows', 'fix: max_length=', 'error_interactive_max_length')
        # the fix names the notebook's parameters, not their config keys (tokenize.max_length, tokenize.truncation)
        assert re.search(r"fix: max_length=\d+ keeps all \d+.*; truncation='keep_start' keeps all \d+", text), text
        assert not nb.errors, nb.errors
    finally: nb.close()


def test_mistakes_in_inspect_show_one_box(lab, browser):
    "max_length=8 is no error here (the report lists the dropped rows and what keeps them; the lint table shows every column in "
    "full); a missing file and an unknown template are."
    nb = Notebook(browser, lab, with_params('inspect.ipynb', 'inspect_errors.ipynb', {'max_length': '8'}))
    try:
        nb.run_all()  # no cell fails: every row is too long, and the report says so
        report = nb.page.locator('.jp-OutputArea-output', has_text='rows: 0 kept, dropped too_long=').first
        # in the notebook's parameters (max_length), not the config key (tokenize.max_length); a line of its own
        assert re.search(r"(?m)^to keep the too-long rows: max_length=\d+ keeps all \d+", report.inner_text()), report.inner_text()
        report.scroll_into_view_if_needed(); nb.shot('error_inspect_max_length', report)
        lint = nb.page.locator('.jp-OutputArea-output table', has_text='text_after_eot').first  # the lint table, every column in full
        shown = lint.inner_text()
        assert CHECKS['text_after_eot'] in shown and CHECKS['unrendered'] in shown and '...' not in shown, shown
        assert re.search(r'text_after_eot\s+info', shown), shown  # ChatML's newline after <|im_end|> never trains
        assert "template='qwen2.5' or template='qwen3'" in shown and 'tokenize.' not in shown, shown  # in its parameter's words
        lint.scroll_into_view_if_needed(); nb.shot('lint_table', lint)

        nb.run_new_cell("data, max_length = 'nope.jsonl', 2048")
        reads = code_cell(nb, 'inspector = Inspector(data, tok, spec, row=row)')
        rerun(nb, reads)
        _check_box(nb, reads, 'MissingFile', "data source 'nope.jsonl' does not exist", 'fix: check the path', 'error_inspect_missing')

        nb.run_new_cell("data, template = None, 'qwen4'")
        rerun(nb, code_cell(nb, 'tok = load_tokenizer(model, template)'))  # the tokenizer and the config with the new template
        rerun(nb, reads)  # which loads the template
        _check_box(nb, reads, 'TemplateError', "'qwen4' names no file", "fix: did you mean 'qwen3'?", 'error_inspect_template')
        assert not nb.errors, nb.errors
    finally: nb.close()
