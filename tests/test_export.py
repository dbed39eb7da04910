"""Export to where people run a model (sft_nb.export): transformers' own GGUF loader reads our GGUF back to the export's
weights (Llama and Qwen2), the Modelfile's TEMPLATE renders the demo's conversations as the chat template does, and
`sft-nb export` writes the GGUF, the Modelfile and the card, refusing the push offline."""
import json, os, shutil, subprocess, sys
from pathlib import Path
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from sft_nb.demo_data import identity_rows
from sft_nb.export import ExportError, ollama_template, render_go_template, go_data, write_gguf


def q8_0_error(w: torch.Tensor) -> torch.Tensor:
    """The most q8_0 moves each weight of a 2-D `w` (rows a multiple of 32): a block of 32 is stored as int8 q times one
    f16 scale d = max|w_block| / 127, so |w - q·d| <= d/2, and the scale's own f16 rounding adds |q|·|d - f16(d)| <=
    127·d·2^-11."""
    d = w.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
    return (d * (0.5 + 127 * 2 ** -11)).expand(-1, 32).reshape(w.shape)


@pytest.mark.parametrize('arch,quant', [('qwen2', 'f16'), ('qwen2', 'q8_0'), ('llama', 'f16')])
def test_transformers_gguf_loader_reads_the_export_back(arch, quant, tiny_path, tiny_llama_path, tmp_path):
    """Every weight read back by `from_pretrained(..., gguf_file=...)` equals the export's: 2-D weights rounded to
    f16 exactly (q8_0: within what its rounding allows, `q8_0_error`), norms and biases exactly; the tokenizer read back
    from the file gives the training tokenizer's ids and carries its chat template."""
    src = tiny_path if arch == 'qwen2' else tiny_llama_path
    out = write_gguf(src, tmp_path / f'model-{quant}.gguf', quant)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name)
    got, ref = model.state_dict(), AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert model.config.model_type == arch and set(got) == set(ref)
    for k, w in ref.items():
        if w.ndim == 1 or quant == 'f16': assert torch.equal(got[k], w.half().float() if w.ndim == 2 else w), k
        else: assert ((got[k] - w).abs() <= q8_0_error(w)).all(), k
    tok, back = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    texts = [tok.apply_chat_template(r['messages'], tokenize=False) for r in identity_rows()['eval']]
    ids = lambda t: [t(x, add_special_tokens=False)['input_ids'] for x in texts]
    assert ids(back) == ids(tok)
    assert back.chat_template == tok.chat_template


def _demo_conversations() -> list[tuple[list[dict], bool]]:
    "(messages, add_generation_prompt): the demo's rows whole, as prompts, without their system message, two turns."
    rows = [r['messages'] for r in identity_rows()['train'][:6] + identity_rows()['eval']]
    pairs = list(zip(rows, rows[1:]))
    padded = [[{**x, 'content': f"\n  {x['content']} \n"} for x in m] for m in rows[:2]]
    return ([(m, False) for m in rows] + [(m[:2], True) for m in rows] + [(m[1:], False) for m in rows]
            + [(a + b[1:], False) for a, b in pairs] + [(a + b[1:2], True) for a, b in pairs] + [(m, False) for m in padded])


@pytest.mark.parametrize('template', [None, 'smollm2', 'qwen2.5'])
def test_modelfile_template_renders_the_demo_conversations_as_the_chat_template(template):
    """The TEMPLATE, rendered as Go's text/template renders it, writes each demo conversation (whole; as a prompt with
    the generation prompt; without its system message, so a default one shows; two turns) to the text
    `apply_chat_template` writes: the tiny model's own template and the shipped ones ('smollm2' is SmolLM2's own, the
    demo's, with generation tags; bench/gguf_client.py checks the demo export's own); texts with whitespace around them
    too. The first stop ends an answer."""
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


@pytest.mark.parametrize('template', ['gemma', 'qwen3', 'chatml', 'llama3', 'phi3', 'mistral'])
def test_modelfile_refuses_a_template_it_cannot_say(template):
    """Qwen3 writes an empty think block into answers, Gemma merges the system prompt into the first user turn; Gemma,
    ChatML, Llama 3, Phi-3 and Mistral trim the whitespace around message texts, which Go's text/template cannot:
    refused, saying why."""
    from sft_nb.models import load_tokenizer
    from sft_nb.templates import load_template
    trims = "it trims the whitespace around message texts (Jinja's trim), which an Ollama TEMPLATE cannot: " * (template != 'qwen3')
    said = f"the chat template '{template}' cannot be written as an Ollama TEMPLATE: {trims}"
    with pytest.raises(ExportError) as e: ollama_template(load_tokenizer('tiny', template), load_template(template))
    assert said in str(e.value) and 'for the roles' in str(e.value), str(e.value)


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


def _run_folder(tiny_path, run) -> Path:
    "A run folder of the tiny model with an HF export and no checkpoint."
    from sft_nb.config import SFTConfig, save_config
    shutil.copytree(tiny_path, run / 'hf')
    save_config(SFTConfig(model={'path': 'tiny'}), run / 'config.yaml')
    return run


def test_cli_export_on_a_full_disk_names_the_file_and_leaves_the_earlier_one(tiny_path, tmp_path):
    """`sft-nb export RUN --gguf` under a file-size limit (`ulimit -f`, as a full disk stops a write): one line naming
    the file, the cause and the bytes written, exit != 0, the earlier GGUF untouched and no partial file left."""
    run = _run_folder(tiny_path, tmp_path / 'run')
    (run / 'gguf').mkdir(); (run / 'gguf' / 'model-f16.gguf').write_bytes(b'the earlier export')
    sft_nb = Path(sys.executable).parent / 'sft-nb'
    p = subprocess.run(['bash', '-c', f'ulimit -f 256; exec {sft_nb} export {run} --gguf'], capture_output=True, text=True,
                       env={**os.environ, 'HF_HUB_OFFLINE': '1'}, timeout=300)
    lines = [l for l in p.stderr.splitlines() if l.startswith('sft-nb export:')]
    assert p.returncode != 0 and lines == [
        'sft-nb export: error: writing gguf/model-f16.gguf: file too large (the file-size limit, ulimit -f, is 262144 '
        'bytes) (262144 bytes written); the earlier one is untouched and nothing partial is left'], p.stderr[-2000:]
    assert sorted(f.name for f in (run / 'gguf').iterdir()) == ['model-f16.gguf']
    assert (run / 'gguf' / 'model-f16.gguf').read_bytes() == b'the earlier export'


@pytest.fixture(scope='module')
def trained_run(tmp_path_factory) -> Path:
    "A tiny run of 2 steps (in this process, no Ray) with its checkpoint of step 2 and no HF export."
    from helpers import cli
    run = tmp_path_factory.mktemp('trained') / 'run'
    tiny = Path(__file__).resolve().parents[1] / 'examples' / 'tiny.yaml'
    code, _, err = cli('train', tiny, 'placement.in_process=true', 'train.num_steps=2', 'checkpoint.export_hf=false',
                       f'checkpoint.run_dir={run}')
    assert code == 0, err[-3000:]
    return run


def test_cli_export_comes_from_the_newest_weights(trained_run, tiny_path, tmp_path):
    """A run whose hf/ holds older weights (step 1) than its latest checkpoint (step 2): `sft-nb export RUN --gguf
    --card` writes hf/ from the checkpoint, the GGUF from that, and the card says step 2; an hf/ of step 2 is kept."""
    from helpers import cli
    from safetensors.torch import load_file
    from sft_nb.checkpoint import record_export
    run = tmp_path / 'run'; shutil.copytree(trained_run, run)
    shutil.copytree(tiny_path, run / 'hf'); record_export(run / 'hf', 1)  # the base's weights, said to be step 1's
    code, out, err = cli('export', run, '--gguf', '--card')
    assert code == 0, err[-3000:]
    assert 'hf/ holds the weights of step 1; the latest checkpoint is step 2: hf/ is written from it' in err, err
    assert 'the weights of step 2' in out
    base, now = load_file(tiny_path / 'model.safetensors'), load_file(run / 'hf' / 'model.safetensors')
    assert any(not torch.equal(base[k], now[k]) for k in base)  # trained weights, not the base's
    assert 'The weights are those of step 2.' in (run / 'hf' / 'README.md').read_text()
    model = AutoModelForCausalLM.from_pretrained(run / 'gguf', gguf_file='model-f16.gguf')
    k = 'model.layers.0.mlp.down_proj.weight'
    assert torch.equal(model.state_dict()[k], now[k].half().float())  # the GGUF holds the newest weights
    stamp = (run / 'hf' / 'model.safetensors').stat().st_mtime_ns
    code, _, err = cli('export', run)
    assert code == 0 and (run / 'hf' / 'model.safetensors').stat().st_mtime_ns == stamp, err  # newest already: kept


def test_cli_export_refuses_a_lora_run_whose_export_is_older(trained_run, tiny_path, tmp_path):
    """A LoRA run whose hf/ records no step and whose checkpoint is of step 2: refused, naming both and the fix."""
    from helpers import cli
    import yaml
    run = tmp_path / 'run'; shutil.copytree(trained_run, run)
    cfg = yaml.safe_load((run / 'config.yaml').read_text()); cfg['model']['lora_r'] = 4
    (run / 'config.yaml').write_text(yaml.safe_dump(cfg))
    shutil.copytree(tiny_path, run / 'hf')
    code, _, err = cli('export', run, '--gguf')
    assert code == 2 and ('is a LoRA run whose latest checkpoint is step 2 and hf/ holds an export that records no '
                          'step') in err and 'fix: resume the run and export it (trainer.export())' in err, err


def test_q8_0_logits_move_within_the_bound_its_rounding_allows(tiny_path, tmp_path):
    """The logits of the q8_0 GGUF (read back by transformers) differ from the export's by no more than the weights'
    rounding allows: to first order, f = the sum of each position's top logit moves by at most sum |df/dw| * e(w), with
    e = `q8_0_error` for q8_0 weights, |w|·2^-11 for 2-D weights kept in f16, 0 for 1-D ones (kept in f32). The bound
    is computed from this model's weights and activations (one backward pass), not chosen. (llama.cpp also rounds the
    activations of its q8_0 matmuls to 8-bit blocks: bench/gguf_client.py's tolerance holds that too.)"""
    out = write_gguf(tiny_path, tmp_path / 'm.gguf', 'q8_0')
    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    q = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = tok.apply_chat_template(identity_rows()['eval'][0]['messages'], tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors='pt').input_ids
    logits = ref(ids).logits[0]
    top = logits.argmax(-1, keepdim=True)
    f = logits.gather(1, top).sum(); f.backward()
    bound = 0.0
    for name, p in ref.named_parameters():  # a tied embedding once, its gradient from both uses
        w = p.detach()
        e = (q8_0_error(w) if w.ndim == 2 and w.shape[-1] % 32 == 0 else w.abs() * 2 ** -11 if w.ndim == 2
             else torch.zeros_like(w))
        bound += float((p.grad.abs() * e).sum())
    with torch.no_grad(): moved = abs(float(q(ids).logits[0].gather(1, top).sum()) - float(f))
    print(f'q8_0: the top logits moved {moved:.4g}, the bound {bound:.4g}')
    assert 0 < moved <= bound, (moved, bound)


def test_cli_export_merges_an_adapter_only_lora_run_into_its_gguf(tiny_path, tmp_path):
    """`sft-nb export RUN --gguf --card` on a LoRA run exported as its adapter alone (`lora_export: adapter`): the GGUF
    holds the adapter merged into the base (every weight the merged model's, rounded to f16; its logits the merged
    model's with those weights), hf/ keeps the adapter and the card says it holds the adapter alone."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from helpers import cli
    from sft_nb.config import SFTConfig, save_config
    run = tmp_path / 'run'
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path), LoraConfig(
        r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'], init_lora_weights=False))  # B != 0: the merge moves weights
    lora.save_pretrained(run / 'hf'); AutoTokenizer.from_pretrained(tiny_path).save_pretrained(run / 'hf')
    save_config(SFTConfig(model={'path': 'tiny', 'lora_r': 4}, checkpoint={'lora_export': 'adapter'}), run / 'config.yaml')
    code, _, err = cli('export', run, '--gguf', '--card')
    assert code == 0, err[-3000:]
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), run / 'hf').merge_and_unload()
    got = AutoModelForCausalLM.from_pretrained(run / 'gguf', gguf_file='model-f16.gguf', dtype=torch.float32).eval()
    ref = merged.state_dict()
    for k, w in got.state_dict().items(): assert torch.equal(w, ref[k].half().float() if ref[k].ndim == 2 else ref[k]), k
    assert not torch.equal(ref['model.layers.0.self_attn.q_proj.weight'],
                           AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()['model.layers.0.self_attn.q_proj.weight'])
    merged.load_state_dict({k: w.half().float() if w.ndim == 2 else w for k, w in ref.items()})
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad(): assert torch.allclose(got(ids).logits, merged.eval()(ids).logits, atol=1e-5)
    assert not (run / 'hf' / 'config.json').exists()  # hf/ keeps the adapter
    assert 'this folder holds the adapter alone' in (run / 'hf' / 'README.md').read_text()
