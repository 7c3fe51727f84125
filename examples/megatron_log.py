"""A job that prints Megatron-LM's progress lines and nothing else Unicron could read: no AgentClient.

``--hang-after N``: after N lines it stops printing and sleeps (a hang, as a stuck collective looks
from outside). The agent parses the lines (``agent/progress.py``) and reports the hang.
``--eval-interval N --eval-ms M``: after the line of every N-th iteration it evaluates for M ms, printing
nothing until Megatron's ``validation loss at iteration`` box (``evaluate_and_print_results``).
``--save-interval N --save-ms M``: after the line of every N-th iteration it saves for M ms between
Megatron's ``saving checkpoint`` and ``successfully saved checkpoint`` lines (rank 0's); with
``--async-save`` it prints ``scheduled an async checkpoint save`` at once and trains on, and the
success line comes with the progress line ``--async-lines`` lines later (the finalization).
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=20, help="progress lines to print")
    p.add_argument("--log-interval", type=int, default=10, help="iterations per line (Megatron's --log-interval)")
    p.add_argument("--iter-ms", type=float, default=20.0, help="milliseconds per iteration")
    p.add_argument("--hang-after", type=int, default=0, help="stop after this many lines and sleep (0: never)")
    p.add_argument("--eval-interval", type=int, default=0, help="evaluate every N iterations (0: never)")
    p.add_argument("--eval-ms", type=float, default=0.0, help="milliseconds an evaluation takes")
    p.add_argument("--save-interval", type=int, default=0, help="save every N iterations (0: never)")
    p.add_argument("--save-ms", type=float, default=0.0, help="milliseconds a (synchronous) save takes")
    p.add_argument("--async-save", action="store_true", help="save as Megatron's --async-save does")
    p.add_argument("--async-lines", type=int, default=3, help="progress lines until an async save finalizes")
    args = p.parse_args()
    total = args.lines * args.log_interval
    finalizing: dict[int, int] = {}  # line number -> the iteration whose async save finalizes there
    for n in range(1, args.lines + 1):
        if args.hang_after and n > args.hang_after:
            time.sleep(3600)
        time.sleep(args.log_interval * args.iter_ms / 1000.0)
        it = n * args.log_interval
        print(f" [2025-08-01 07:19:37] iteration {it:8d}/{total:8d} | consumed samples: {it * 64:12d} |"
              f" elapsed time per iteration (ms): {args.iter_ms:.1f} | learning rate: 1.500000E-04 |"
              f" global batch size:    64 | lm loss: 1.043863E+01 | loss scale: 1.0 | grad norm: 2.620 |"
              f" number of skipped iterations:   0 | number of nan iterations:   0 |", flush=True)
        if n in finalizing:
            print(f"  successfully saved checkpoint from iteration {finalizing.pop(n):7d} to /ckpt"
                  " [ t 1/1, p 1/1 ]", flush=True)
        if args.eval_interval and it % args.eval_interval == 0:
            time.sleep(args.eval_ms / 1000.0)  # forward passes only; Megatron prints when done
            print("-" * 100)
            print(f" validation loss at iteration {it} | lm loss value: 1.043863E+01 | lm loss PPL: 3.4E+04 | ")
            print("-" * 100, flush=True)
        if args.save_interval and it % args.save_interval == 0:
            print(f"saving checkpoint at iteration {it:7d} to /ckpt in torch_dist format", flush=True)
            if args.async_save:
                print(f"  scheduled an async checkpoint save at iteration {it:7d} to /ckpt", flush=True)
                finalizing[n + args.async_lines] = it
            else:
                time.sleep(args.save_ms / 1000.0)
                print(f"  successfully saved checkpoint from iteration {it:7d} to /ckpt [ t 1/1, p 1/1 ]",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
