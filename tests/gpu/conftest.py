"""tests/gpu's own fixtures, so that this folder runs alone: `tools/gpu_check.sh` runs it with `--confcutdir tests/gpu` on the
GPU machine, where `tests/conftest.py` cannot load (it looks for `../shared` beside the checkout, which does not travel
there, and sets up the browser tests' JupyterLab). In the whole suite (`pytest tests`) these fixtures stand in for
`tests/conftest.py`'s in this folder only and do the same: the tiny model, its tokenizer, one Ray cluster per session."""
import os, sys
from pathlib import Path
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `from helpers import run_cfg`
for k, v in (('HF_HUB_OFFLINE', '1'), ('TRANSFORMERS_OFFLINE', '1'), ('HF_DATASETS_OFFLINE', '1'), ('RAY_USAGE_STATS_ENABLED', '0'),
             ('RAY_AUTH_MODE', 'disabled'), ('TOKENIZERS_PARALLELISM', 'false')):
    os.environ.setdefault(k, v)


@pytest.fixture(scope='session')
def tiny_path() -> Path:
    from sft_nb.models import tiny_chat_model
    return tiny_chat_model()


@pytest.fixture(scope='session')
def tiny_tok(tiny_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope='session')
def ray_session() -> str:
    "One local Ray cluster (capped object store) for the session, shut down at its end if this fixture started it."
    import ray
    from sft_nb.workers import init_ray
    started = init_ray(num_cpus=4, object_store_memory=256 * 1024**2)
    try: yield ray.get_runtime_context().gcs_address
    finally:
        if started: ray.shutdown()
