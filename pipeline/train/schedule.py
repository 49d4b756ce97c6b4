"""The learning-rate schedule, a function of the samples seen so far and nothing else.

Apart from the run's state so that the one formula every step follows reads on one
screen, and so that a resume, on any number of ranks, lands on the same rate.
"""
import math

BASE_BATCH = 256  # --lr is the rate for this global batch


def learning_rate(args, global_batch, seen, total):
    """--lr scaled linearly to the global batch, warmed up linearly over max(10% of training,
    50 steps) but at most half of it, then cosine decay to zero.

    The floor of 50 steps is what lets a large batch start: 2 ranks x 256 (peak 0.2) over
    a 3.5-step warm-up sent the loss to 7 and ended at chance; with 50 steps it learned,
    and 2 ranks x 32 learned either way (docs/benchmarks.md, "The learning rate's warm-up floor"). Counted in samples,
    not steps, so that a resume on another world size stays on schedule.
    """
    peak = args.lr * global_batch / BASE_BATCH
    warmup = max(1, min(total // 2, max(total // 10, 50 * global_batch)))
    if seen < warmup:
        return peak * (seen + global_batch) / (warmup + global_batch)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (seen - warmup) / max(1, total - warmup))))
