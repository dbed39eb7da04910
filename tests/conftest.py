"""Shared fixtures: the tiny model is built once per test run; real data comes from ../shared."""
import os
from pathlib import Path
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
os.environ.setdefault('RAY_USAGE_STATS_ENABLED', '0')
os.environ.setdefault('RAY_AUTH_MODE', 'disabled')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

SHARED = next(p / 'shared' for p in Path(__file__).resolve().parents if (p / 'shared' / 'DESIGN.md').exists())


@pytest.fixture(scope='session')
def shared() -> Path:
    return SHARED


@pytest.fixture(scope='session')
def tiny_path() -> Path:
    from sft_nb.models import tiny_chat_model
    return tiny_chat_model()


@pytest.fixture(scope='session')
def tiny_tok(tiny_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_path)
