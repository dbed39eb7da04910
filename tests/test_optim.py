"""The LR schedule (`sft_nb.optim.lr_at`) with warmup and decay together: the warmup climbs to the peak, and the decay
spans the steps after it, from the peak at the first of them to `min_lr_ratio · lr` at the last step of the run."""
import math
import pytest
from sft_nb.optim import lr_at


@pytest.mark.parametrize('schedule', ['cosine', 'linear'])
def test_decay_spans_the_steps_after_warmup(schedule):
    "10 steps, 3 of warmup, min_lr_ratio 0.1: steps 0-2 climb to the peak, steps 3-9 decay over 6 intervals from it to 0.1."
    lrs = [lr_at(s, 2.0, 10, schedule, warmup_steps=3, min_lr_ratio=0.1) for s in range(10)]
    assert lrs[:3] == pytest.approx([2 / 3, 4 / 3, 2.0])
    shape = (lambda f: 1 - f) if schedule == 'linear' else (lambda f: 0.5 * (1 + math.cos(math.pi * f)))
    assert lrs[3:] == pytest.approx([2.0 * (0.1 + 0.9 * shape(k / 6)) for k in range(7)])
    assert lrs[3] == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.2)
