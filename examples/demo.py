"""The main job: compile a GPT for a local 4-process cluster, train, compare with eager.

    make demo                         # or: python examples/demo.py --steps 5 --world-size 4

Each rank builds the same model (same seed), `ah.compile` captures model + loss, plans
(data parallelism over the 4 processes, chosen by the cost model), rewrites the graph and
trains. Rank 0 also trains an identical eager copy on the whole batch, so the table shows
compiled and eager losses side by side, with the step times of both.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import autohybrid as ah


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return ah.models.gpt(**config)


def main(rank: int, args: argparse.Namespace, config: dict) -> dict:
    model = build(config)
    eager = build(config) if rank == 0 else None
    batches = [ah.models.example_batch(model, args.batch, seed=step) for step in range(args.steps)]
    (x0,), y0 = batches[0]
    compiled = ah.compile(model, ah.Cluster.local(args.world_size), (x0,), loss_fn=loss_fn,
                          example_targets=y0,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=3e-3) if eager is not None else None
    rows = []
    for (x,), y in batches:
        start = time.perf_counter()
        loss = compiled.train_step(x, y)
        compiled_s = time.perf_counter() - start
        eager_loss = eager_s = float("nan")
        if eager is not None:
            start = time.perf_counter()
            eager_opt.zero_grad()
            reference = loss_fn(eager(x), y)
            reference.backward()
            eager_opt.step()
            eager_s = time.perf_counter() - start
            eager_loss = reference.item()
        rows.append((loss.item(), eager_loss, compiled_s, eager_s))
    result = {"rows": rows}
    state = compiled.full_state_dict()  # every rank: it gathers shards and stages
    if rank == 0:
        result["explain"] = compiled.explain()
        ref_state = eager.state_dict()
        result["max_param_diff"] = max((state[k] - ref_state[k]).abs().max().item()
                                       for k in ref_state)
    return result


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--start-method", default=None, choices=("fork", "spawn", "forkserver"),
                        help="how the ranks start (default: spawn on CUDA, fork on CPU)")
    args = parser.parse_args(argv)
    config = dict(layers=args.layers, hidden=args.hidden, heads=4, vocab=512, seq=64)
    print(f"autohybrid demo: GPT {config} on Cluster.local({args.world_size}), global batch "
          f"{args.batch}, {args.steps} AdamW steps\n")
    results = ah.launch(main, ah.Cluster.local(args.world_size), args=(args, config),
                        start_method=args.start_method)
    first = results[0]
    print(first["explain"], "\n")
    print(f"{'step':>4}  {'compiled loss':>14}  {'eager loss':>14}  {'|diff|':>9}  "
          f"{'compiled s':>10}  {'eager s':>8}")
    for step, (loss, eager_loss, compiled_s, eager_s) in enumerate(first["rows"]):
        print(f"{step:>4}  {loss:>14.6f}  {eager_loss:>14.6f}  {abs(loss - eager_loss):>9.2e}  "
              f"{compiled_s:>10.4f}  {eager_s:>8.4f}")
    agree = all(r["rows"][i][0] == first["rows"][i][0] for r in results
                for i in range(len(first["rows"])))
    print(f"\nall {args.world_size} ranks report the same loss: {agree}; largest parameter "
          f"difference from eager after {args.steps} steps: {first['max_param_diff']:.2e}")
    return {"results": results, "agree": agree}


if __name__ == "__main__":
    run()
