"""How many of the default retrieval items' prompt tokens a prefix cache leaves to compute.

Builds `quantkit eval`'s retrieval items for MODEL (its tokenizer and chat template), then replays the runtime's
prefix-cache rule on them in order: a prompt reuses its longest prefix of whole cached blocks (the block hashes
of runtime/block_manager.py) and caches all of its own. Items admitted one after another, so an upper bound on
what the engine reuses when several prefill in the same step.

    python bench/retrieval_prefix.py qwen2.5-coder-1.5b [--lengths 1024,2048] [--per-task 3] [--block-size 16]
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    from quantkit.calib.data import builtin_texts
    from quantkit.eval import retrieval
    from quantkit.eval.backends import RuntimeBackend
    from quantkit.eval.runner import RETRIEVAL_TASKS
    from quantkit.models import resolve
    from quantkit.runtime.block_manager import BlockManager

    backend = RuntimeBackend(resolve(args.model).path, "model")
    lengths = [int(n) for n in args.lengths.split(",")]
    items = retrieval.generate(list(RETRIEVAL_TASKS), lengths, args.per_task, args.seed, backend.count,
                               retrieval.Filler(builtin_texts("eval")))
    bs, cached, total, computed = args.block_size, set(), 0, 0
    hashes = BlockManager(0, bs)
    for it in items:
        ids = backend.tokenizer(backend.chat_prompt([{"role": "user", "content": it.prompt}]), add_special_tokens=False)["input_ids"]
        chain = hashes._chain(ids, (len(ids) - 1) // bs)  # the engine's own block hashes
        reused = next((i for i, x in enumerate(chain) if x not in cached), len(chain)) * bs
        total, computed = total + len(ids), computed + len(ids) - reused
        cached.update(chain)
    print(f"{args.model}: {len(items)} items at {args.lengths} tokens, {total} prompt tokens, "
          f"{computed} left to compute ({computed / total:.1%})")


if __name__ == "__main__":
    main()
