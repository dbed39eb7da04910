"""Export to where people run a model (sft_nb.export): transformers' own GGUF loader reads our GGUF back to the export's
weights (Llama and Qwen2), the Modelfile's TEMPLATE renders the demo's conversations as the chat template does, and
`sft-nb export` writes the GGUF, the Modelfile and the card, refusing the push offline."""
import json, shutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from sft_nb.demo_data import identity_rows
from sft_nb.export import ExportError, ollama_template, render_go_template, go_data, write_gguf


@pytest.mark.parametrize('arch,quant', [('qwen2', 'f16'), ('qwen2', 'q8_0'), ('llama', 'f16')])
def test_transformers_gguf_loader_reads_the_export_back(arch, quant, tiny_path, tiny_llama_path, tmp_path):
    """Every weight read back by `from_pretrained(..., gguf_file=...)` equals the export's: 2-D weights rounded to
    f16 exactly (q8_0: within one quantization step of their row), norms and biases exactly; the tokenizer read back
    from the file gives the training tokenizer's ids and carries its chat template."""
    src = tiny_path if arch == 'qwen2' else tiny_llama_path
    out = write_gguf(src, tmp_path / f'model-{quant}.gguf', quant)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name)
    got, ref = model.state_dict(), AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert model.config.model_type == arch and set(got) == set(ref)
    for k, w in ref.items():
        if w.ndim == 1 or quant == 'f16': assert torch.equal(got[k], w.half().float() if w.ndim == 2 else w), k
        else: assert ((got[k] - w).abs() <= w.abs().amax(1, keepdim=True) / 127).all(), k
    tok, back = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    texts = [tok.apply_chat_template(r['messages'], tokenize=False) for r in identity_rows()['eval']]
    ids = lambda t: [t(x, add_special_tokens=False)['input_ids'] for x in texts]
    assert ids(back) == ids(tok)
    assert back.chat_template == tok.chat_template


def _demo_conversations() -> list[tuple[list[dict], bool]]:
    "(messages, add_generation_prompt): the demo's rows whole, as prompts, without their system message, two turns."
    rows = [r['messages'] for r in identity_rows()['train'][:6] + identity_rows()['eval']]
    pairs = list(zip(rows, rows[1:]))
    return ([(m, False) for m in rows] + [(m[:2], True) for m in rows] + [(m[1:], False) for m in rows]
            + [(a + b[1:], False) for a, b in pairs] + [(a + b[1:2], True) for a, b in pairs])


@pytest.mark.parametrize('template', [None, 'smollm2', 'chatml', 'llama3', 'qwen2.5', 'phi3', 'mistral'])
def test_modelfile_template_renders_the_demo_conversations_as_the_chat_template(template):
    """The TEMPLATE, rendered as Go's text/template renders it, writes each demo conversation (whole; as a prompt with
    the generation prompt; without its system message, so a default one shows; two turns) to the text
    `apply_chat_template` writes: the tiny model's own template and the shipped ones ('smollm2' is SmolLM2's own, the
    demo's, with generation tags; bench/gguf_client.py checks the demo export's own). The first stop ends an answer."""
    from sft_nb.models import load_tokenizer
    from sft_nb.templates import load_template
    tok = load_tokenizer('tiny', template)
    text = load_template(template) if template else tok.chat_template
    go, stops = ollama_template(tok, text)
    msgs = identity_rows()['eval'][0]['messages']
    after_answer = tok.apply_chat_template(msgs, tokenize=False, chat_template=text).split(msgs[-1]['content'])[1]
    assert after_answer.startswith(stops[0])
    for msgs, gen in _demo_conversations():
        want = tok.apply_chat_template(msgs, tokenize=False, chat_template=text, add_generation_prompt=gen)
        assert render_go_template(go, go_data(msgs)) == want, (template, [m['role'] for m in msgs])


@pytest.mark.parametrize('template', ['gemma', 'qwen3'])
def test_modelfile_refuses_a_template_it_cannot_say(template):
    "Gemma merges the system prompt into the first user turn, Qwen3 writes an empty think block into answers: refused."
    from sft_nb.models import load_tokenizer
    from sft_nb.templates import load_template
    said = f"the chat template '{template}' cannot be written as an Ollama TEMPLATE: for the roles"
    with pytest.raises(ExportError, match=said):
        ollama_template(load_tokenizer('tiny', template), load_template(template))


def test_cli_export_writes_gguf_modelfile_card_and_refuses_the_push_offline(tiny_path, tmp_path, capsys, monkeypatch):
    """`sft-nb export RUN_DIR --gguf --quant q8_0 --push REPO` on a run folder with an export: the GGUF and its
    Modelfile, the card (base model, eval losses, chart) in hf/, then the push refused in one line, exit 2."""
    from sft_nb.cli import main
    from sft_nb.config import SFTConfig, save_config
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    run = tmp_path / 'run'
    shutil.copytree(tiny_path, run / 'hf')
    save_config(SFTConfig(model={'path': 'tiny'}), run / 'config.yaml')
    lines = [{'kind': 'eval', 'step': 0, 'eval_loss': 5.0}, {'kind': 'train', 'step': 1, 'loss': 4.0},
             {'kind': 'eval', 'step': 1, 'eval_loss': 4.5}]
    (run / 'metrics.jsonl').write_text('\n'.join(json.dumps(l) for l in lines) + '\n')
    with pytest.raises(SystemExit) as e: main(['export', str(run), '--gguf', '--quant', 'q8_0', '--push', 'me/quill'])
    err = capsys.readouterr().err
    assert e.value.code == 2
    said = 'sft-nb export: error: push: offline (HF_HUB_OFFLINE is set): nothing was uploaded to me/quill'
    assert said in err
    assert (run / 'gguf' / 'model-q8_0.gguf').stat().st_size > 0
    assert 'FROM ./model-q8_0.gguf' in (run / 'gguf' / 'Modelfile').read_text()
    card = (run / 'hf' / 'README.md').read_text()
    assert 'Base model: `tiny`' in card and 'Eval loss: final 4.5000 (step 1), best 4.5000 (step 1).' in card
    assert (run / 'hf' / 'loss.svg').exists()
