#!/usr/bin/env python
"""One row of many turns (issue 66 item 9): time and peak memory of tokenizing one conversation of N user/assistant
pairs, truncated to `--max-length` tokens, with the tiny chat model's tokenizer; and `sft-nb inspect --row` on it.

    HF_HUB_OFFLINE=1 python bench/long_turns.py                          # 1k / 10k / 100k pairs
    HF_HUB_OFFLINE=1 python bench/long_turns.py --pairs 125,1000 --full-upto 1000   # the full computation too (default: up to 1k)

Each measurement runs in its own process (`resource.getrusage` peak RSS is per process: one row size cannot inherit
another's peak). Templates: the tiny model's own ChatML (no generation tags: spans from prefix renders) and the shipped
tagged `chatml` (spans from one tagged render). Paths:

  view      `tokenize_rows(..., keep_offsets=True)`: what `sft-nb inspect` and the inspector do (message segments too)
  dataset   `tokenize_rows(..., keep_offsets=False)`: what `tokenize_dataset` does
  full      the same row with every turn located (`render_turns` without a limit, then `_chat_example`): the cost
            before this change, as the peer in the same run (quadratic: only at small sizes)
  inspect   (first at 2 pairs: the CLI's fixed cost) `sft-nb inspect ROW.jsonl --row 0 --max-length L --truncation keep_start --color never`, wall time of the CLI
            process (Python start and imports included), stdout to /dev/null

Prints one table row per (path, template, pairs): seconds (best of --repeats), peak RSS of the process, RSS before the
row was tokenized, tokens kept and trained, renders of the template.
"""
import argparse, json, os, resource, subprocess, sys, tempfile, time
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib


def row(pairs: int) -> dict:
    words = 'the a cat sat on mat quite well and then left again soon'.split()
    ms = [{'role': 'system', 'content': 'Be brief.'}]
    for i in range(pairs):
        ms += [{'role': 'user', 'content': f'question {i}: ' + ' '.join(words[(i + k) % 13] for k in range(i % 9 + 1))},
               {'role': 'assistant', 'content': f'answer {i}: ' + ' '.join(words[(i * 3 + k) % 13] for k in range(i % 7 + 2))}]
    return {'messages': ms}


def one(path: str, template: str, pairs: int, max_length: int, repeats: int) -> dict:
    "In this process: tokenize the row `repeats` times, best time, peak RSS."
    from unittest import mock
    from transformers import AutoTokenizer
    from sft_nb.config import TokenizeConfig
    from sft_nb.models import tiny_chat_model
    from sft_nb.templates import TemplateRenderer, load_template, template_info
    from sft_nb.renderers import tokenize_rows, _chat_example, _encodings
    from sft_nb.formats import normalize_row
    from sft_nb.spans import render_turns, span_renderer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model())
    tpl = load_template('chatml') if template == 'chatml' else None
    spec = TokenizeConfig(max_length=max_length, truncation='keep_start', chat_template=tpl)
    tokenize_rows([row(2)], tok, spec, 'messages')  # the template's probes
    r = row(pairs)
    calls, real = [0], TemplateRenderer.__call__
    def count(self, *a, **k): calls[0] += 1; return real(self, *a, **k)
    def run():
        if path == 'full':
            msgs = normalize_row(r, 'messages')['messages']
            info = template_info(tok, tpl, {})
            text, spans, segs, own = render_turns(span_renderer(tok, tpl, {}, info), msgs, None, info, 'all_assistant',
                                                  segments=True)
            return _chat_example(text, _encodings(tok, [text])[0], msgs, info, 'all_assistant', spans, segs, own,
                                 max_length, 'keep_start')
        good, bad = tokenize_rows([r], tok, spec, 'messages', keep_offsets=path == 'view')
        assert not bad, bad
        return good[0][1]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = float('inf')
    with mock.patch.object(TemplateRenderer, '__call__', count):
        for _ in range(repeats):
            calls[0] = 0
            t = time.perf_counter(); ex = run(); best = min(best, time.perf_counter() - t)
    return {'seconds': best, 'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'before': before,
            'tokens': len(ex), 'trained': ex.n_trained, 'renders': calls[0]}


def inspect_cli(pairs: int, max_length: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / 'row.jsonl'
        f.write_text(json.dumps(row(pairs)) + '\n')
        cmd = [str(Path(sys.executable).parent / 'sft-nb'), 'inspect', str(f), '--row', '0', '--max-length',
               str(max_length), '--truncation', 'keep_start', '--color', 'never']
        t = time.perf_counter()
        p = subprocess.run(['/usr/bin/time', '-f', '%M', *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        s = time.perf_counter() - t
        assert p.returncode == 0, p.stderr
        return {'seconds': s, 'peak': int(p.stderr.strip().splitlines()[-1]) * 1024, 'before': 0, 'tokens': min(max_length, 5 * pairs),
                'trained': '', 'renders': ''}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--pairs', default='1000,10000,100000')
    ap.add_argument('--max-length', type=int, default=512)
    ap.add_argument('--repeats', type=int, default=2)
    ap.add_argument('--full-upto', type=int, default=1000, help='time the full computation up to this many pairs (quadratic)')
    ap.add_argument('--one', default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        path, template, pairs = a.one.split(':')
        print(json.dumps(one(path, template, int(pairs), a.max_length, a.repeats))); return
    print(f'max_length {a.max_length}, truncation keep_start, mode all_assistant, best of {a.repeats}')
    print(f"{'path':8} {'template':12} {'pairs':>7} {'seconds':>8} {'peak RSS':>9} {'RSS before':>10} {'tokens':>6} "
          f"{'trained':>7} {'renders':>7}")
    m = inspect_cli(2, a.max_length)  # Python start, imports and the tokenizer: the CLI's cost on any row
    print(f"{'inspect':8} {'own (prefix)':12} {2:>7,} {m['seconds']:>8.2f} {m['peak'] / 2**20:>7.0f}MB", flush=True)
    for pairs in map(int, a.pairs.split(',')):
        for path in ['view', 'dataset'] + (['full'] if pairs <= a.full_upto else []):
            for template in ('own', 'chatml'):
                out = subprocess.run([sys.executable, __file__, '--one', f'{path}:{template}:{pairs}', '--max-length',
                                      str(a.max_length), '--repeats', str(a.repeats)], capture_output=True, text=True,
                                     env={**os.environ, 'TOKENIZERS_PARALLELISM': 'false'})
                if out.returncode: print(out.stderr[-2000:]); continue
                m = json.loads(out.stdout.strip().splitlines()[-1])
                name = 'own (prefix)' if template == 'own' else 'chatml (tags)'
                print(f"{path:8} {name:12} {pairs:>7,} {m['seconds']:>8.2f} {m['peak'] / 2**20:>7.0f}MB "
                      f"{m['before'] / 2**20:>8.0f}MB {m['tokens']:>6} {m['trained']:>7} {m['renders']:>7}", flush=True)
        m = inspect_cli(pairs, a.max_length)
        print(f"{'inspect':8} {'own (prefix)':12} {pairs:>7,} {m['seconds']:>8.2f} {m['peak'] / 2**20:>7.0f}MB "
              f"{'':>10} {m['tokens']:>6}", flush=True)


if __name__ == '__main__':
    main()
