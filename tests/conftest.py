"""Shared fixtures: the tiny model is built once per test run; real data comes from ../shared."""
import os, signal
from pathlib import Path
import pytest
from jupyter_lab import lab, browser  # noqa: F401 (one JupyterLab server and one Chromium for the session's browser tests)

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
os.environ.setdefault('RAY_USAGE_STATS_ENABLED', '0')
os.environ.setdefault('RAY_AUTH_MODE', 'disabled')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# Ctrl-C as a user's Python (and a Jupyter kernel) gets it: a run started in the background (nohup, `cmd &` without job
# control) inherits SIGINT ignored, and Python then keeps it ignored; the interrupt tests and the `sft-nb` subprocesses
# they signal need Python's own handler.
signal.signal(signal.SIGINT, signal.default_int_handler)

SHARED = Path(__file__).resolve().parents[2] / 'shared'  # the development data beside the checkout


@pytest.fixture(scope='session')
def shared() -> Path:
    "../shared beside the checkout (real data and templates); a checkout without it (the GPU machine) skips the tests that read it."
    if not SHARED.exists(): pytest.skip('no ../shared beside this checkout')
    return SHARED


@pytest.fixture(scope='session')
def tiny_path() -> Path:
    from sft_nb.models import tiny_chat_model
    return tiny_chat_model()


@pytest.fixture(scope='session')
def tiny_tok(tiny_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope='session')
def tiny_llama_path(tiny_tok, tmp_path_factory) -> Path:
    """A random Llama (SmolLM2-135M-Instruct's architecture and head layout: 9 heads, 3 KV heads, tied embeddings, no
    attention bias) at ~0.1M parameters, with the tiny tokenizer: the Llama paths without the 135M model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=len(tiny_tok), hidden_size=72, intermediate_size=192, num_hidden_layers=3, num_attention_heads=9,
                      num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=512,
                      eos_token_id=tiny_tok.eos_token_id, pad_token_id=tiny_tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp('tiny_llama')
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d); tiny_tok.save_pretrained(d)
    return d


@pytest.fixture(scope='session')
def ray_session() -> str:
    """One local Ray cluster (capped object store) for the whole session; always shut down. In-process trainers join it;
    yields its address for subprocesses and notebook kernels (`placement.ray_address`, the notebooks' `ray_address`).
    6 logical CPUs: the groups this process keeps warm hold at most half (`trim_parked`), the rest is for the groups of a
    test and of the kernels and `sft-nb` processes beside it."""
    import ray
    from sft_nb.workers import init_ray
    started = init_ray(num_cpus=6, object_store_memory=256 * 1024**2)
    try: yield ray.get_runtime_context().gcs_address
    finally:
        if started: ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Whole files, longest first (tests/durations.json, from an earlier run; a file it lacks counts as its median): two
    workers that take files as they free up then end together, where a long file started last runs alone. Within a file
    the order stays (module fixtures, ordered browser steps). tools/test.sh runs with `--no-loadscope-reorder`, or xdist
    would order the files by their number of tests."""
    import json, statistics
    seconds = {k: v for k, v in json.loads((Path(__file__).with_name('durations.json')).read_text()).items() if k.startswith('tests/')}
    unknown = statistics.median(seconds.values())
    order = {}
    for k, item in enumerate(items): order.setdefault(item.nodeid.split('::')[0], k)
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split('::')[0], unknown), order[item.nodeid.split('::')[0]]))
