"""Chat with the model: `trainer.chat` streams a reply from the current weights on the workers (2 FSDP ranks:
rank 0 picks each token and broadcasts it), between steps only; the workers show no progress bars (their stderr is a
red box in a notebook)."""
import json, threading, time
from pathlib import Path
import pytest
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer, TrainerBusy
from sft_nb.live import TrainerPanel
from helpers import run_cfg

ROWS = identity_rows()


def test_chat_streams_the_current_weights(tiny_path, tmp_path, ray_session):
    cfg = run_cfg(tiny_path, tmp_path, optim__lr=3e-3, train__micro_batch_size=4, train__num_steps=200, eval__samples=0,
                  placement__workers_per_node=2)
    with SFTTrainer(cfg, train_data=ROWS['train']) as t:
        t.fit(4)
        msgs = [{'role': 'user', 'content': 'Who are you?'}]
        pieces = []
        reply = t.chat(msgs, max_new_tokens=16, on_text=pieces.append)
        assert len(pieces) > 1 and ''.join(pieces) == reply  # streamed, piece by piece, into the same text
        assert reply.strip() == t.generate([msgs], 16)[0]  # greedy: what HF's generate answers with the same weights
        a, b = (t.chat('Who are you?', 16, temperature=1.0, top_p=0.95, seed=7) for _ in range(2))
        assert a == b  # sampled, the same seed: the same reply (both ranks drew the token rank 0 picked)
        t.step()
        assert t.chat(msgs, 16).strip() == t.generate([msgs], 16)[0]  # after a step: the new weights answer, no stale cache
        # while a fit runs in another thread (the panel's Fit), chat is refused; after Stop it answers
        panel = TrainerPanel(t)
        panel.fit_button.click()
        while t.global_step < 7: time.sleep(0.02)
        with pytest.raises(TrainerBusy, match='trainer.fit\\(\\) is running in another thread'): t.chat(msgs, 4)
        assert panel.chat.send_button.disabled
        panel.stop_button.click(); panel.wait(120)
        assert not panel.chat.send_button.disabled
        panel.chat.text.value = 'Who are you?'; panel.chat.send_button.click(); panel.wait(120)
        assert panel.chat.messages[-1] == {'role': 'assistant', 'content': t.chat(msgs, 128)}
        assert 'model:</b>' in panel.chat.output.value


def test_workers_show_no_progress_bars(ray_session):
    "The workers' transformers/hub progress bars are off (init_ray's worker environment)."
    import ray
    @ray.remote
    def bars_on():
        from transformers.utils import logging
        return logging.is_progress_bar_enabled()
    assert ray.get(bars_on.remote()) is False


FIX = Path(__file__).parent / 'fixtures'


def test_tool_call_samples_and_panel_lines(tiny_path, tmp_path, ray_session):
    """Tool-calling eval data: the samples answer with the rows' tools in the prompt, their references show the tool calls;
    the panel prints one line per evaluation (no eval_loss beside the set's own loss) and one per save."""
    data = str(FIX / 'tool_calls.jsonl')
    cfg = run_cfg(tiny_path, tmp_path, train__num_steps=2, train__eval_every=2, eval__max_new_tokens=8,
                  tokenize__chat_template=str(FIX / 'templates' / 'qwen3.jinja'), data__train=[{'path': data}], data__eval={'tools': {'path': data}})
    with SFTTrainer(cfg) as t:
        panel = TrainerPanel(t)
        panel.fit_button.click(); panel.wait(300)
        s = t.samples
        assert [r['step'] for r in s] == [2] * 4 and t.samples_why == ''
        assert s[0]['reference'] == '→ get_weather({"city": "Paris"})' and s[1]['reference'] == 'Oslo is at 17 °C: not warm.'
        assert s[1]['messages'][-1]['role'] == 'tool' and s[1]['prompt'] == '{"city": "Oslo", "celsius": 17}'
        prompt = t.tokenizer.decode(t.prompt_ids([{'role': 'user', 'content': s[0]['prompt']}], json.loads(Path(data).read_text().splitlines()[0])['tools']))
        assert 'Current weather of a city' in prompt and prompt.endswith('<|im_start|>assistant\n')  # the rows' tools, the run's template
        assert '→ get_weather(' in panel.samples.value
        evals = [l for l in panel.log.text.splitlines() if l.startswith('eval at step')]
        assert evals == [f"eval at step 2: tools loss {t.last_eval['tools_loss']:.4f} ppl {t.last_eval['tools_ppl']:.2f}"], evals
        panel.save_button.click(); panel.wait(120)
        assert [l for l in panel.log.text.splitlines() if 'step_000002' in l] == [f"checkpoint {t.run_dir / 'checkpoints' / 'step_000002'}"]
        from transformers import AutoTokenizer
        out = AutoTokenizer.from_pretrained(t.export())  # the export renders as the run trained: its template, not the model's own
        assert out.chat_template == (FIX / 'templates' / 'qwen3.jinja').read_text() != AutoTokenizer.from_pretrained(tiny_path).chat_template
        msgs, tools = s[1]['messages'], s[1].get('tools')
        text = out.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        assert out(text, add_special_tokens=False)['input_ids'] == t.prompt_ids(msgs, tools)


def test_early_stopping_keeps_the_best_model(tiny_path, tmp_path, ray_session):
    """interactive.ipynb's pair of callbacks on its defaults (the tiny model at lr 3e-3 overfits the identity rows):
    EarlyStopping ends the fit before num_steps, and run_dir/best holds the model of the lowest eval loss; evaluating again
    with no step in between counts nowhere (early stopping, eval_metrics)."""
    from transformers import AutoModelForCausalLM
    from sft_nb.callbacks import EarlyStopping, KeepBest
    cfg = run_cfg(tiny_path, tmp_path, optim__lr=3e-3, optim__schedule='cosine', optim__warmup_steps=10, train__micro_batch_size=4,
                  train__num_steps=300, train__eval_every=10, data__eval_fraction=0.1, eval__samples=0)
    es = EarlyStopping(patience=3)
    with SFTTrainer(cfg, [es, KeepBest()], train_data=ROWS['train']) as t:
        t.fit()
        n_evals, bad, last = len(t.eval_metrics), es.bad, t.last_eval
        for _ in range(3): assert t.evaluate() is last  # no step since: re-reported, counted nowhere
        assert (len(t.eval_metrics), es.bad) == (n_evals, bad)
        losses = [(e['step'], e['eval_loss']) for e in t.eval_metrics]
        best = min(losses, key=lambda e: e[1])
        assert t.global_step < 300 and t.global_step == losses[-1][0] == best[0] + 30, losses  # 3 evaluations without a new best
        assert t.best['step'] == best[0] and t.best['eval_loss'] == best[1]
        assert json.loads((t.run_dir / 'best' / 'best.json').read_text())['step'] == best[0]
        ref = {k: v.detach().clone() for k, v in t.backend.full_state()[0].items()}
    hf = AutoModelForCausalLM.from_pretrained(t.run_dir / 'best')
    assert any(not (hf.state_dict()[k] == v).all() for k, v in ref.items() if k in hf.state_dict())  # best is not the last step's model
