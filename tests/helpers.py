"""Helpers shared by the test modules (pytest puts tests/ on sys.path: `from helpers import run_cfg`)."""


def run_cfg(model_path, run_dir, **overrides) -> dict:
    """A small training config: one worker, a global batch of 8 single-row micro-batches, one constant-LR step, a
    jsonl tracker and no HF export. `section__key=value` overrides (e.g. `optim__lr=1e-3`) set one key each."""
    cfg = {'model': {'path': str(model_path)},
           'optim': {'lr': 1e-2, 'schedule': 'constant'},
           'train': {'global_batch_size': 8, 'micro_batch_size': 1, 'num_steps': 1},
           'placement': {'workers_per_node': 1}, 'checkpoint': {'run_dir': str(run_dir), 'export_hf': False},
           'logging': {'trackers': ['jsonl']}}
    for k, v in overrides.items():
        section, key = k.split('__')
        cfg.setdefault(section, {})[key] = v
    return cfg


def trained_runs(ex, tok) -> list[str]:
    "The decoded runs of consecutive trained tokens of an example."
    runs, cur = [], []
    for i, m in zip(ex.input_ids, ex.loss_mask):
        if m: cur.append(i)
        elif cur: runs.append(tok.decode(cur)); cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def local_run(cfg: dict, train_data, n_steps: int | None = None):
    """The steps of a 1-rank `cfg` in this process, no Ray: the trainer's own data plan and its backend's worker (a 1-rank
    gloo group), stepped as `SFTTrainer.step` steps it. Returns (per-step metrics: loss, grad_norm, weight_sum, n_trained,
    positions (the micro-batches' input_ids elements);
    the final full state).
    Reference runs for parity tests: what runs under Ray (ranks, dealing, the transport) is compared against this."""
    from sft_nb.backends import get_backend
    from sft_nb.models import load_model_inputs
    from sft_nb.trainer import SFTTrainer
    from sft_nb.workers import free_port
    t = SFTTrainer(cfg, train_data=train_data)
    c = t.cfg
    assert c.placement.world_size == 1, 'local_run is one rank'
    t.tokenizer, t.processor = load_model_inputs(c.model.path, c.tokenize.chat_template)
    t._prepare_data().plan()
    w = get_backend(c.placement.backend)(0, 1, model=c.model, optim=c.optim, total_steps=t.total_steps,
                                         seed=c.train.seed, use_gpu=False, placement=c.placement, train=c.train,
                                         packed_length=c.pack_capacity if c.packing.enabled else None)
    w.init_dist('127.0.0.1', free_port())
    try:
        t.data.use_model(w.setup())
        steps = []
        for step in range(t.total_steps if n_steps is None else n_steps):
            (batch,), weight_sum, n_trained, _ = t.data.rank_batches(t.data.global_batch(step))
            fb = w.forward_backward(batch, weight_sum)
            loss = fb['nll_sum'] / (weight_sum if weight_sum > 0 else 1)
            steps.append({'loss': loss, 'grad_norm': w.optim_step(False)['grad_norm'], 'weight_sum': weight_sum, 'n_trained': n_trained,
                          'positions': sum(b['input_ids'].numel() for b in batch)})
        return steps, w.full_state()
    finally: w.shutdown()


def cli(*args) -> tuple[int, str, str]:
    "`sft-nb ARGS` in this process (`sft_nb.cli.main`; on a session's Ray cluster when one is up): (exit code, stdout, stderr)."
    import contextlib, io
    from sft_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try: code = main([str(a) for a in args]) or 0
        except SystemExit as e: code = e.code
    return code, out.getvalue(), err.getvalue()


def fsdp_rank(rank, world, sp, port, model_cfgs, mbs, n_global, out):
    """One FSDP rank: for each of `model_cfgs` in turn (one gloo group), setup, forward_backward on its replica's
    micro-batches, eval and per-token losses. Rank 0 puts ('ok', its results, one per config) on `out`; a rank that fails
    puts ('error', its traceback), so the test says why, at once. Each result's forward_backward dict gets `warnings`: the
    messages of the warnings its setup and forward_backward raised. A config may be a (ModelConfig, TrainConfig) pair: the
    run's loss (`train.loss`)."""
    import traceback, warnings
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import OptimConfig, PlacementConfig
    try:
        got = []
        for i, model_cfg in enumerate(model_cfgs):
            model_cfg, train_cfg = model_cfg if isinstance(model_cfg, tuple) else (model_cfg, None)
            w = FSDPWorker(rank, world, model_cfg, OptimConfig(), total_steps=1,
                           placement=PlacementConfig(workers_per_node=world, sequence_parallel=sp), train=train_cfg)
            if i == 0: w.init_dist('127.0.0.1', port)  # the later configs' workers join the same group
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter('always')
                    w.setup()
                    mine = mbs[rank // sp]  # the sp ranks of a replica get the same micro-batches
                    r = w.forward_backward(mine, n_global) | {'warnings': [str(m.message) for m in seen]}
                grads = {k: (p.grad.full_tensor() if hasattr(p.grad, 'full_tensor') else p.grad).numpy()  # by value
                         for k, p in w.model.named_parameters() if p.grad is not None}
                got.append((r, grads, w.eval_loss(mine), w.token_losses(mine)))
            finally:
                if i == len(model_cfgs) - 1: w.shutdown()
        if rank == 0: out.put(('ok', got))
    except BaseException:
        out.put(('error', f'rank {rank} of {world}:\n{traceback.format_exc()}'))
        raise


def _rank_results(got, errors=()) -> list[tuple]:
    """Rank 0's (result, gradients as tensors, eval, per-token losses) per config from what `fsdp_rank` put, or the
    failing rank's traceback."""
    import torch
    kind, value = got
    if kind == 'error': raise AssertionError(f'a spawned FSDP rank failed: {value}')
    assert not errors, f'a spawned FSDP rank failed after rank 0 reported: {errors[0]}'
    return [(r, {k: torch.from_numpy(v) for k, v in grads.items()}, ev, tl) for r, grads, ev, tl in value]


def spawn(world, sp, model_cfgs, mbs, n_global):
    """Run `world` FSDP ranks (spawned processes, a gloo group, no Ray; `sp` ranks share each replica's rows) through each of
    `model_cfgs` and return rank 0's (forward_backward result, full gradients, eval, per-token losses), one per config."""
    import queue
    import torch.multiprocessing as mp
    from sft_nb.workers import free_port
    ctx, port = mp.get_context('spawn'), free_port()
    out = ctx.Queue()
    ps = [ctx.Process(target=fsdp_rank, args=(r, world, sp, port, model_cfgs, mbs, n_global, out)) for r in range(world)]
    for p in ps: p.start()
    try: got = out.get(timeout=300)
    finally:
        for p in ps: p.join(timeout=60)
    errors = []
    while True:  # a rank that failed after rank 0 reported (in its shutdown, say) left its traceback here
        try: errors.append(out.get(timeout=1)[1])
        except queue.Empty: break
    result = _rank_results(got, errors)
    assert all(p.exitcode == 0 for p in ps), f'exit codes by rank: {[p.exitcode for p in ps]}'
    return result


def view_warnings(result: dict) -> list[str]:
    """torch's FSDP2 warnings that a sharded module returned a view (its pre-backward hook, the all-gather, is lost if
    anything changes that view in place) among a `spawn` result's `warnings`: matched on the start of the message."""
    return [m for m in result['warnings'] if m.startswith('FSDP2-wrapped module')]


def one_rank(model_cfgs, mbs, n_global):
    "What `spawn(1, 1, ...)` returns, computed in this process (a 1-rank gloo group): the reference the spawned ranks match."
    import queue
    from sft_nb.workers import free_port
    out = queue.Queue()
    fsdp_rank(0, 1, 1, free_port(), model_cfgs, mbs, n_global, out)
    return _rank_results(out.get_nowait())


def step_grads(w, mbs, n, chunk=None):
    """(result, gradients) of one `forward_backward(mbs, n)` on an in-process worker, gradients zeroed before and after;
    `chunk` sets the worker's loss chunk first (0: the one-shot head)."""
    if chunk is not None: w.loss_chunk = chunk
    w.opt.zero_grad(set_to_none=True)
    r = w.forward_backward(mbs, n)
    g = {k: p.grad.clone() for k, p in w.model.named_parameters() if p.grad is not None}
    w.opt.zero_grad(set_to_none=True)
    return r, g
