"""Vision-language SFT: processor-exact ids and masks on image rows, bad/truncated image rows, mixed text+image training, resume, packing refusal."""
import base64, io, json
import numpy as np
import pytest
from sft_nb.config import ConfigError
from helpers import run_cfg
from sft_nb.config import TokenizeConfig
from sft_nb.renderers import tokenize_conversation
from sft_nb.vision import vision_conversation, tokenize_vision, tokenize_vision_rows
from sft_nb.tokenize import tokenize_dataset


@pytest.fixture(scope='module')
def proc():
    from sft_nb.vlm_models import load_processor
    from sft_nb.models import resolve_model_path
    return load_processor(resolve_model_path('tiny-vlm'))


@pytest.fixture(scope='module')
def demo(shared):
    return json.loads((shared / 'datasets' / 'mllm_demo.json').read_text())


def reference(proc, conv):
    "The processor's own ids for the conversation, images inline."
    it = iter(conv['images'])
    msgs = [{**m, 'content': [{'type': 'image', 'image': next(it)} if p['type'] == 'image' else p for p in m['content']]}
            if isinstance(m['content'], list) else m for m in conv['messages']]
    return proc.apply_chat_template(msgs, tokenize=True, return_dict=True)['input_ids'][0]


def trained(proc, ex):
    runs, cur = [], []
    for i, m in zip(ex.input_ids + [None], ex.loss_mask + [0]):
        if m: cur.append(i)
        elif cur: runs.append(proc.tokenizer.decode(cur)); cur = []
    return runs


def placeholder_ids(proc):
    return set(proc.tokenizer.convert_tokens_to_ids(['<|image_pad|>', '<|vision_start|>', '<|vision_end|>']))


@pytest.mark.parametrize('mode', ['all_assistant', 'last_assistant'])
def test_masks_on_image_rows(proc, demo, shared, mode):
    "Every mllm_demo row (single image, multi-turn, image in a later turn): ids == processor, no placeholder trained, text as for text rows."
    later = [r for r in demo if r['messages'][2]['content'].endswith('<image>')]
    assert later, 'the demo set has an image in a later turn'
    for row in demo:
        conv = vision_conversation(row, shared / 'datasets')
        ex = tokenize_vision(conv, proc, mode=mode)
        assert ex.input_ids == reference(proc, conv)
        assert not any(m for i, m in zip(ex.input_ids, ex.loss_mask) if i in placeholder_ids(proc))
        assert sum(e - s for s, e in ex.image_tokens) == sum(int(np.prod(g)) // 4 + 2 for g in ex.image_grid_thw)
        text_only = [{'role': m['role'], 'content': m['content'] if isinstance(m['content'], str)
                      else ''.join(p.get('text', '') for p in m['content'])} for m in conv['messages']]
        assert trained(proc, ex) == trained(proc, tokenize_conversation(text_only, proc.tokenizer, mode=mode, template=proc.chat_template))
        n_asst = sum(m['role'] == 'assistant' for m in conv['messages'])
        assert len(trained(proc, ex)) == (n_asst if mode == 'all_assistant' else 1)


def test_content_parts_data_uri_and_pil(proc, shared):
    from PIL import Image
    img = Image.open(shared / 'datasets' / 'mllm_demo_data' / '2.jpg')
    buf = io.BytesIO(); img.save(buf, format='PNG')
    uri = 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode()
    msgs = [{'role': 'system', 'content': 'Be brief.'},
            {'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}, {'role': 'assistant', 'content': 'Hello.'},
            {'role': 'user', 'content': [{'type': 'text', 'text': 'Look: '}, {'type': 'image', 'image': uri},
                                         {'type': 'text', 'text': ' and '}, {'type': 'image', 'image': img}]},
            {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Two players.'}]}]
    conv = vision_conversation({'messages': msgs})
    ex = tokenize_vision(conv, proc)
    assert ex.input_ids == reference(proc, conv)
    assert trained(proc, ex) == ['Hello.<|im_end|>', 'Two players.<|im_end|>']
    assert len(ex.image_grid_thw) == 2 and len(ex.image_tokens) == 2



def test_several_images_pair_with_their_markers_in_order(proc, shared):
    """Two `<image>` markers (one in each user turn) and an images column of two images of different sizes: the k-th marker
    takes the k-th image. Ids, pixel values and grids equal the processor's on the conversation written by hand with each
    image in its place; the images swapped give other ids (the placeholders' lengths follow the images)."""
    from PIL import Image
    d = shared / 'datasets' / 'mllm_demo_data'
    a, b = (Image.open(d / f).convert('RGB') for f in ('1.jpg', '2.jpg'))
    row = {'messages': [{'role': 'user', 'content': '<image>What is this?'}, {'role': 'assistant', 'content': 'A goal.'},
                        {'role': 'user', 'content': 'And <image> this one?'}, {'role': 'assistant', 'content': 'A team.'}],
           'images': ['mllm_demo_data/1.jpg', 'mllm_demo_data/2.jpg']}
    by_hand = [{'role': 'user', 'content': [{'type': 'image', 'image': a}, {'type': 'text', 'text': 'What is this?'}]},
               {'role': 'assistant', 'content': 'A goal.'},
               {'role': 'user', 'content': [{'type': 'text', 'text': 'And '}, {'type': 'image', 'image': b}, {'type': 'text', 'text': ' this one?'}]},
               {'role': 'assistant', 'content': 'A team.'}]
    want = proc.apply_chat_template(by_hand, tokenize=True, return_dict=True, return_tensors='np')
    ex = tokenize_vision(vision_conversation(row, shared / 'datasets'), proc)
    assert ex.input_ids == want['input_ids'][0].tolist()
    assert ex.image_grid_thw == want['image_grid_thw'].tolist() and ex.image_grid_thw[0] != ex.image_grid_thw[1]  # sizes differ
    assert np.array_equal(ex.pixel_values, np.asarray(want['pixel_values'], dtype=np.float32))
    assert [e - s for s, e in ex.image_tokens] == [int(np.prod(g)) // 4 + 2 for g in want['image_grid_thw']]
    assert trained(proc, ex) == ['A goal.<|im_end|>', 'A team.<|im_end|>']
    swapped = tokenize_vision(vision_conversation({**row, 'images': row['images'][::-1]}, shared / 'datasets'), proc)
    assert swapped.input_ids != ex.input_ids and swapped.image_grid_thw == ex.image_grid_thw[::-1]

def test_bad_and_truncated_image_rows(proc, demo, shared, tmp_path):
    (tmp_path / 'broken.jpg').write_bytes(b'\xff\xd8 not really')
    rows = [demo[1], {**demo[1], 'images': [str(tmp_path / 'broken.jpg')]}, {**demo[1], 'images': ['mllm_demo_data/gone.jpg']}]
    good, bad = tokenize_vision_rows(rows, proc, TokenizeConfig(max_length=None), shared / 'datasets')
    assert [g[0] for g in good] == [0]
    assert [b[:2] for b in bad] == [(1, 'bad_image'), (2, 'bad_image')]
    assert 'broken.jpg' in bad[0][2] and 'gone.jpg' in bad[1][2]
    # a cut inside the image: dropped and reported, never cut inside an image
    full = good[0][1]
    spec = TokenizeConfig(max_length=full.image_tokens[0][0] + 3, truncation='keep_start')
    src = tmp_path / 'd.json'; src.write_text(json.dumps([demo[1]]))
    (tmp_path / 'mllm_demo_data').symlink_to(shared / 'datasets' / 'mllm_demo_data')
    ds, rep = tokenize_dataset(str(src), proc, spec, use_cache=False)
    assert len(ds) == 0 and rep.bad_rows[0][1] == 'truncated_image' and 'cut through image 0' in rep.bad_rows[0][2]


def vlm_cfg(shared, run_dir, **kw):
    "tiny-vlm on mllm_demo image rows mixed with 18 text rows, 10 steps of 2 micro-batches of 4."
    return run_cfg('tiny-vlm', run_dir, **{
        'data__train': [{'path': str(shared / 'datasets' / 'mllm_demo.json')}, {'path': 'sft_nb:identity', 'max_rows': 18}],
        'tokenize__max_length': 512, 'tokenize__cache_dir': str(run_dir / 'cache'),
        'train__micro_batch_size': 4, 'train__num_steps': 10, **kw})


def test_vlm_trains_mixed_rows_and_resumes(shared, tmp_path, ray_session):
    "10 steps on mllm_demo image rows mixed with text rows: the loss falls; 5 steps + resume + 5 == 10 straight."
    from sft_nb.trainer import SFTTrainer
    with SFTTrainer(vlm_cfg(shared, tmp_path / 'full')) as t:
        assert t.processor is not None and t.data_report.n_dropped == 0
        kinds = [{'image' if 'pixel_values' in t.data.collate_items(mb) else 'text'} for mb in
                 [t.data.global_batch(s)[j:j + 4] for s in range(10) for j in (0, 4)]]
        assert {'image'} in kinds and {'text'} in kinds  # micro-batches of both kinds (and mixed ones)
        assert any(len({bool(t.data.example(k).get('image_grid_thw')) for k in t.data.global_batch(s)}) == 2 for s in range(10))
        full = t.fit()['loss'].tolist()
        ev = t.evaluate() if t.data.eval_sets else None
    print('losses', [round(x, 3) for x in full])
    assert len(full) == 10 and full[-1] < full[0] and np.mean(full[-3:]) < np.mean(full[:3])
    with SFTTrainer(vlm_cfg(shared, tmp_path / 'half')) as t:
        t.fit(5); ckpt = t.save()
    with SFTTrainer(vlm_cfg(shared, tmp_path / 'half', checkpoint__resume=str(ckpt))) as r:
        assert r.global_step == 5
        resumed = r.fit()['loss'].tolist()
    assert resumed[:5] == full[:5]
    assert resumed[5:] == pytest.approx(full[5:], rel=4e-6), (resumed, full)


def test_vlm_two_workers_match_one(shared, tmp_path, ray_session):
    """The same 3 mixed image/text global batches on 2 FSDP2 workers (2 micro-batches of 2 each) and on 1 (4 of 2): same losses.
    The ranks are dealt rows 0, 2 | 1, 3, so their micro-batches are not the 1-worker ones: Adam's eps=1e-5 keeps its update
    linear in near-zero gradients, where eps=1e-8 turns their float noise into ±lr weight noise (as in test_split_invariance)."""
    from sft_nb.trainer import SFTTrainer
    runs = {}
    for workers in (1, 2):
        with SFTTrainer(vlm_cfg(shared, tmp_path / f'w{workers}', train__num_steps=3, train__micro_batch_size=2, optim__eps=1e-5,
                                placement__workers_per_node=workers)) as t:
            runs[workers] = t.fit()['loss'].tolist()
    assert runs[2] == pytest.approx(runs[1], rel=4e-6), runs


def test_packing_image_rows_is_refused(shared, tmp_path, ray_session):
    from sft_nb.trainer import SFTTrainer
    with pytest.raises(ConfigError, match='multi-dimensional'):
        SFTTrainer(vlm_cfg(shared, tmp_path, packing__enabled=True, packing__capacity=512)).setup()


def test_train_notebook_runs_a_vlm_job(shared, tmp_path, ray_session):
    "examples/train.ipynb (papermill, `sft-nb run`) trains the tiny VLM on mllm_demo.json and exports it with its image processor."
    from pathlib import Path
    from helpers import cli
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / 'vlm'
    code, _, err = cli('run', root / 'examples' / 'train.ipynb', '-p', 'model', 'tiny-vlm', '-p', 'train_data', shared / 'datasets' / 'mllm_demo.json',
                       '-p', 'max_steps', '3', '-p', 'global_batch_size', '4', '-p', 'eval_fraction', '0.2', '-p', 'ray_address', ray_session,
                       '--run-dir', run)
    assert code == 0, err[-3000:]
    summary = json.loads((run / 'summary.json').read_text())
    assert summary['steps'] == 3 and len(summary['train_losses']) == 3 and summary['data_report']['n_kept'] == 6
    assert (run / 'hf' / 'preprocessor_config.json').exists()
    from sft_nb.vlm_models import load_processor, is_vlm
    assert is_vlm(run / 'hf') and load_processor(run / 'hf').image_token_id is not None


def test_inspector_draws_image_thumbnails(proc, demo, shared):
    "Image placeholder tokens are drawn as one thumbnail chip with the token count it expands to (HTML and ANSI)."
    import re
    from sft_nb.inspect import example_markup
    ex = tokenize_vision(vision_conversation(demo[1], shared / 'datasets'), proc)
    assert ex.image_tokens
    html = example_markup(ex, proc.tokenizer)
    thumbs = re.findall(r'<span class="k n r-user img"[^>]*><img src="data:image/png;base64,[^"]+"[^>]*> (\d+) tokens</span>', html)
    assert [int(n) for n in thumbs] == [e - s for s, e in ex.image_tokens]
    chips = len(re.findall(r'<span class="k ', html))
    assert chips == len(ex.input_ids) - sum(e - s - 1 for s, e in ex.image_tokens)  # each image's run became one chip
    ansi = example_markup(ex, proc.tokenizer, form='ansi')
    assert f'[image 0: {ex.image_tokens[0][1] - ex.image_tokens[0][0]} tokens]' in ansi
