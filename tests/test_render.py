"""The renderer seam: image rows go through `tokenize_dataset` (processes, Ray, cache) exactly as text rows do."""
import json
import numpy as np
import pytest
from sft_nb.config import TokenizeConfig
from sft_nb.tokenize import tokenize_dataset, make_renderer
from sft_nb.vision import ProcessorRenderer, vision_conversation, tokenize_vision


@pytest.fixture(scope='module')
def proc():
    from sft_nb.vlm_models import load_processor
    from sft_nb.models import resolve_model_path
    return load_processor(resolve_model_path('tiny-vlm'))


@pytest.fixture()
def image_source(shared, tmp_path):
    "mllm_demo image rows twice over, with text rows and one bad image row between them (images relative to the file)."
    demo = json.loads((shared / 'datasets' / 'mllm_demo.json').read_text())
    text = [{'messages': [{'role': 'user', 'content': f'Hi {i}'}, {'role': 'assistant', 'content': f'Hello {i}!'}]} for i in range(4)]
    bad = {'messages': [{'role': 'user', 'content': '<image>Who?'}, {'role': 'assistant', 'content': 'Nobody.'}], 'images': ['mllm_demo_data/gone.jpg']}
    rows = demo[:3] + text[:2] + [bad] + demo[3:] + demo + text[2:]
    src = tmp_path / 'mixed.json'; src.write_text(json.dumps(rows))
    (tmp_path / 'mllm_demo_data').symlink_to(shared / 'datasets' / 'mllm_demo_data')
    return src, len(rows)


def test_make_renderer_picks_by_object(proc, tiny_tok):
    assert type(make_renderer(proc)).__name__ == 'ProcessorRenderer'
    assert type(make_renderer(tiny_tok)).__name__ == 'ChatRenderer'


def test_image_rows_parallel_and_ray_equal_serial(proc, image_source, tmp_path):
    "num_proc=2 and ray_shards=2 (a real local Ray cluster, capped object store) give the serial dataset and report."
    import ray
    from sft_nb.workers import init_ray
    src, n = image_source
    spec = TokenizeConfig(max_length=None)
    serial, rep = tokenize_dataset(str(src), proc, spec, use_cache=False, batch_size=4)
    assert rep.n_rows == n and rep.n_dropped == 1 and rep.bad_rows[0][:2] == (5, 'bad_image')
    assert {'pixel_values', 'image_grid_thw'} <= set(serial.column_names) and rep.n_kept == len(serial) == n - 1
    assert sum(bool(g) for g in serial['image_grid_thw']) > len(serial) // 2
    par, rep_par = tokenize_dataset(str(src), proc, spec, use_cache=False, batch_size=4, num_proc=2)
    assert par.to_dict() == serial.to_dict() and rep_par == rep
    cached, rep_c = tokenize_dataset(str(src), proc, spec, cache_dir=tmp_path / 'cache', num_proc=2)
    assert cached.to_dict() == serial.to_dict() and rep_c == rep
    started = init_ray(num_cpus=2, object_store_memory=128 * 1024**2)
    try:
        on_ray, rep_ray = tokenize_dataset(str(src), proc, spec, use_cache=False, batch_size=4, ray_shards=2)
        assert on_ray.to_dict() == serial.to_dict() and rep_ray == rep
        ray_cached, rep_rc = tokenize_dataset(str(src), proc, spec, cache_dir=tmp_path / 'cache_ray', ray_shards=2)
        assert ray_cached.to_dict() == serial.to_dict() and rep_rc == rep
        # a task on a node that sees the cache folder writes its part there itself: nothing comes back through the driver
        from sft_nb.tokenize import ray_part, part_name
        rows = json.loads(src.read_text())[:3]
        out = tmp_path / 'parts'; out.mkdir()
        st, table = ray.get(ray.remote(ray_part).remote(rows, 0, make_renderer(proc, spec, src.parent), 'messages', 2, str(out), part_name(0, 1)))
        assert table is None and st['n_kept'] == 3 and (out / part_name(0, 1)).stat().st_size > 0
    finally:
        if started: ray.shutdown()



@pytest.mark.parametrize('bad_line', [False, True], ids=['clean', 'bad_line'])
def test_jsonl_shards_read_by_ray_tasks(tiny_tok, tmp_path, ray_session, bad_line):
    "ray_shards on a local .jsonl: each task gets line offsets and reads its own rows; dataset and report equal serial's (a bad line too)."
    import ray
    from sft_nb.rows import JsonlRows
    from sft_nb.tokenize import ray_part
    lines = [json.dumps({'messages': [{'role': 'user', 'content': f'question {i}'}, {'role': 'assistant', 'content': f'answer {i}'}]})
             for i in range(40)]
    if bad_line: lines[17] = '{"messages": [oops'
    src = tmp_path / 'rows.jsonl'; src.write_text('\n'.join(lines) + '\n')
    serial, rep = tokenize_dataset(str(src), tiny_tok, use_cache=False, batch_size=8)
    assert rep.n_dropped == int(bad_line) and len(serial) == 40 - int(bad_line)
    on_ray, rep_ray = tokenize_dataset(str(src), tiny_tok, cache_dir=tmp_path / 'cache', batch_size=8, ray_shards=3)
    assert on_ray.to_dict() == serial.to_dict() and rep_ray == rep
    shard = JsonlRows(src).shard(10, 20)  # what a task is sent: offsets, not rows
    assert shard.starts.nbytes + shard.ends.nbytes == 160
    if not bad_line:
        st, table = ray.get(ray.remote(ray_part).remote(shard, 10, make_renderer(tiny_tok), 'messages', 4))
        assert st['n_kept'] == 10 and table.column('index').to_pylist() == list(range(10, 20))


# ChatML with image parts and Hermes-style tool calls: what a Qwen2.5-VL-like template renders
TOOL_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}\n<tool_call>\n{{ tc.function | tojson }}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def trained_text(proc, ex):
    return proc.tokenizer.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])


def test_image_row_with_tool_calls_trains_them(proc, shared, tmp_path):
    "An image row whose assistant calls a tool: processor-exact ids, the call is trained (and masked with train_on_tool_calls=False)."
    row = {'messages': [{'role': 'user', 'content': '<image>Where is this? Look it up.'},
                        {'role': 'assistant', 'content': 'Let me search.', 'tool_calls': [{'type': 'function', 'function': {'name': 'search', 'arguments': '{"q": "stadium"}'}}]},
                        {'role': 'tool', 'content': '{"result": "Camp Nou"}'},
                        {'role': 'assistant', 'content': 'It is Camp Nou.'}],
           'images': ['mllm_demo_data/1.jpg'],
           'tools': [{'type': 'function', 'function': {'name': 'search', 'description': 'web search', 'parameters': {'type': 'object', 'properties': {'q': {'type': 'string'}}}}}]}
    conv = vision_conversation(row, shared / 'datasets')
    assert conv['tools'][0]['function']['name'] == 'search'
    ex = tokenize_vision(conv, proc, template=TOOL_VL_TEMPLATE)
    msgs = [{**m, 'content': [{'type': 'image', 'image': conv['images'][0]} if p['type'] == 'image' else p for p in m['content']]}
            if isinstance(m['content'], list) else m for m in conv['messages']]
    ref = proc.apply_chat_template(msgs, chat_template=TOOL_VL_TEMPLATE, tools=conv['tools'], tokenize=True, return_dict=True)['input_ids'][0]
    assert ex.input_ids == list(ref)
    text = trained_text(proc, ex)
    assert '<tool_call>' in text and '"search"' in text and 'stadium' in text and 'Let me search.' in text and 'Camp Nou.' in text
    assert 'Camp Nou"' not in text  # the tool's result is input, not a target
    off = tokenize_vision(conv, proc, template=TOOL_VL_TEMPLATE, train_on_tool_calls=False)
    assert off.input_ids == ex.input_ids
    assert '<tool_call>' not in trained_text(proc, off) and 'Let me search.' in trained_text(proc, off)
    assert [k for *_, k in off.masked_parts] == ['tool_calls']
    # the same row through the dataset pipeline, with the template given in the spec
    src = tmp_path / 'tools.json'; src.write_text(json.dumps([row]))
    (tmp_path / 'mllm_demo_data').symlink_to(shared / 'datasets' / 'mllm_demo_data')
    ds, rep = tokenize_dataset(str(src), proc, TokenizeConfig(max_length=None, chat_template=TOOL_VL_TEMPLATE), use_cache=False)
    assert rep.n_kept == 1 and ds[0]['input_ids'] == ex.input_ids and ds[0]['loss_mask'] == ex.loss_mask
    assert len(ds[0]['image_grid_thw']) == 1


def test_processor_fill_row_comes_from_the_processor(proc):
    "The fill row: the smallest image the image processor makes, its placeholder as the template renders it, nothing trained."
    from sft_nb.collate import collate_padded
    r = ProcessorRenderer(proc, TokenizeConfig())
    dm = r.fill_row()
    grid = dm['image_grid_thw'][0]
    assert sum(dm['loss_mask']) == 0
    assert dm['input_ids'].count(proc.image_token_id) == int(np.prod(grid)) // proc.image_processor.merge_size ** 2
    assert proc.tokenizer.decode(dm['input_ids']).startswith('<|vision_start|>')
    b = r.collate([dm], collate_padded([dm], proc.tokenizer.pad_token_id))
    assert b['pixel_values'].shape == (int(np.prod(grid)), r.patch_dim()) and b['n_trained'] == 0
