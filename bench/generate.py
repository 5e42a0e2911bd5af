"""Generation under training: tokens per second of HuggingFace's greedy
generate on a GPT-2 (6 layers, width 256, built from a config), for the
plain model, for stage 3 the naive way (engine.module.generate: every
module gathered per token; synced_gpus on several ranks) and for
engine.generate (the model gathered once: [Note: generation] in
python/zero/engine/_generation.py). One process, then 2 gloo ranks (each
generating its own batch, ranks in step). Each figure is the median of
--rounds generations after a warm-up.

Usage: python bench/generate.py [--new-tokens 64] [--batch 4] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def gpt2():
    import transformers
    cfg = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=8, vocab_size=4096,
                                  n_positions=256, eos_token_id=None, bos_token_id=None,
                                  pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def timed(fn, rounds):
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(rank, world, args):
    import zero
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    prompt = torch.randint(1, 4096, (args.batch, 16),
                           generator=torch.Generator().manual_seed(rank))
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
    tokens = args.batch * args.new_tokens
    plain = gpt2()
    with torch.no_grad():
        rows = {"plain model": timed(lambda: plain.generate(prompt, **kw), args.rounds)}
    model = gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3)

    def naive():
        with torch.no_grad():
            engine.module.generate(prompt, synced_gpus=world > 1, **kw)
    rows["stage 3, per-module gathers"] = timed(naive, args.rounds)
    rows["stage 3, engine.generate"] = timed(lambda: engine.generate(prompt, **kw),
                                             args.rounds)
    engine.close()
    return {name: tokens / seconds for name, seconds in rows.items()}


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    queue.put((rank, measure(rank, world, args)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(var, None)
    results = {1: measure(0, 1, args)}
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    results[2] = per_rank[0]  # rank 0's; both generate the same amount
    print(f"GPT-2 6 x 256, batch {args.batch} x 16-token prompts, {args.new_tokens} new tokens "
          f"greedy, median of {args.rounds}; tokens/s per rank")
    print(f"{'':<30}{'1 process':>12}{'x plain':>9}{'2 ranks':>12}{'x plain':>9}")
    for name in results[1]:
        row = [results[w][name] for w in (1, 2)]
        print(f"{name:<30}{row[0]:>12.1f}{row[0] / results[1]['plain model']:>9.2f}"
              f"{row[1]:>12.1f}{row[1] / results[2]['plain model']:>9.2f}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _results import write_json
        write_json(args.json, {"args": vars(args), "tokens_per_s": results})


if __name__ == "__main__":
    main()
