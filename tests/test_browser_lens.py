"""The loss lens in a real JupyterLab + headless Chromium (the session's server and browser, tests/jupyter_lab.py): examples/lens.ipynb
trains a few steps on the tiny model, distilling from a teacher, and lists the hardest rows; a click on one opens it in
the inspector in loss mode (chips shaded by loss, a legend), the "before training → now" toggle shades the change, and
"kd loss" shades the distillation loss (the teacher's guesses on hover). Screenshots:
`build/browser/lens_*.png`."""
from __future__ import annotations
import re
from jupyter_lab import Notebook
import pytest
from sft_nb.inspect import COLORS

pytestmark = pytest.mark.timeout(900)


def _inspector_html(nb) -> str:
    return nb.page.locator('.sft-nb-ranked .sft-nb-inspector .widget-html').first.inner_html()


def test_ranked_rows_open_in_loss_mode(lab, browser, tmp_path):
    """The run distills (lens.ipynb's `teacher`: the tiny model trained 30 steps on the same rows), so one Run All shows
    the NLL views every run has and the 'kd loss' view a distillation run adds."""
    from jupyter_lab import with_params
    from sft_nb.demo_data import identity_rows
    from sft_nb.models import tiny_chat_model
    from sft_nb.trainer import SFTTrainer
    from helpers import run_cfg
    with SFTTrainer(run_cfg(tiny_chat_model(), tmp_path / 'teacher', train__num_steps=30, train__micro_batch_size=4, optim__lr=3e-3,
                            placement__in_process=True), train_data=identity_rows()['train']) as t:
        t.fit(); teacher = t.export(tmp_path / 'teacher_hf')
    nb = Notebook(browser, lab, with_params('lens.ipynb', 'lens_kd.ipynb', {'teacher': repr(str(teacher))}))
    nb.run_all()
    ranked = nb.page.locator('.sft-nb-ranked')
    buttons = ranked.locator('button.jupyter-button', has_text=re.compile(r'^#\d+ '))
    assert buttons.count() == 10, buttons.all_inner_texts()
    text = buttons.nth(3).inner_text()
    m = re.fullmatch(r'#4 train_data row (\d+) · mean (\d+\.\d+)', text.strip())  # rows given in memory are named train_data
    assert m, text
    source, row, mean = 'train_data', int(m.group(1)), m.group(2)
    before = _inspector_html(nb)
    buttons.nth(3).click()
    nb.until(f'''() => {{ const h = document.querySelector('.sft-nb-ranked .sft-nb-inspector .widget-html');
        return h && h.textContent.includes('{source} row {row} ·') && h.textContent.includes('loss mean {mean}'); }}''')
    assert nb.page.locator('.sft-nb-ranked .sft-nb-inspector .widget-slider .widget-readout').first.inner_text().strip() == str(row)
    html_now = _inspector_html(nb)
    assert html_now != before
    chips = ranked.locator('.sft-nb-inspector .sftnb span.k.loss')
    n_loss = chips.count()
    assert n_loss > 5, n_loss
    # every loss chip is filled from the scale (not the plain trained green) and says its loss and top guesses on hover
    title = chips.first.get_attribute('title')
    assert re.search(r'\| loss \d+\.\d{3} \(first \d+\.\d{3}, Δ [+-]\d+\.\d{3}\) \| top: ', title), title
    fills = set(chips.evaluate_all('els => els.map(e => getComputedStyle(e).backgroundColor)'))
    assert 'rgb(123, 211, 137)' not in fills and len(fills) > 1, fills
    legend = ranked.locator('.sft-nb-inspector .loss-legend')
    assert legend.count() == 1 and legend.is_visible() and 'loss (nats)' in legend.inner_text()
    # on the screenshot too: masked chips grey, trained ones shaded by loss; the plain trained green only on the legend's
    # 'trained' chip (~1,100 pixels; a row of green token chips is tens of thousands)
    ranked.scroll_into_view_if_needed(); nb.shot('lens_ranked_loss', ranked, (COLORS['masked'],), {COLORS['trained']: 2000})

    ranked.locator('.sft-nb-inspector .widget-toggle-buttons button', has_text='before training → now').click()
    nb.until('''() => !!document.querySelector('.sft-nb-ranked .sft-nb-inspector .loss-legend[data-view="diff"]')''')
    h = ranked.locator('.sft-nb-inspector .widget-html').first.inner_text()
    assert 'first scored at step 0' in h and 'easier' in h, h[:500]
    assert ranked.locator('.sft-nb-inspector .sftnb span.k.loss').count() == n_loss
    nb.shot('lens_ranked_diff', ranked, (COLORS['masked'],), {COLORS['trained']: 2000})
    # the distillation view: chips shaded by the run's own per-token (KD) loss; the hover adds it and the teacher's guesses
    ranked.locator('.sft-nb-inspector .widget-toggle-buttons button', has_text='kd loss').click()
    nb.until('''() => !!document.querySelector('.sft-nb-ranked .sft-nb-inspector .loss-legend[data-view="train"]')''')
    h = ranked.locator('.sft-nb-inspector .widget-html').first.inner_text()
    assert 'train loss mean' in h and "train loss (nats): the run's own, per token" in h, h[:500]
    title = ranked.locator('.sft-nb-inspector .sftnb span.k.loss').first.get_attribute('title')
    assert re.search(r'\| top: .* \| train loss \d+\.\d{3} \| teacher: ', title), title
    nb.shot('lens_kd_loss', ranked, (COLORS['masked'],), {COLORS['trained']: 2000})
    nb.check_clean()
    cell = nb.run_new_cell("trainer.shutdown(); print('workers stopped')")
    nb.see(cell.locator('.jp-OutputArea-output', has_text='workers stopped'))
    nb.close()

