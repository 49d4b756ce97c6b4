"""What a job's batches may take in memory, from the job's own numbers, before anything is read.

A manifest's `shape` and the command line's --batch-size decide how large a batch is, and
the loader multiplies it: every DataLoader worker keeps (prefetch_factor + 2) batches in its
shared-memory ring (pipeline.data.loader.BatchRing), the trainer copies each batch out and
makes a float32 copy of it, and each (rank, worker) holds a shuffle window per source. A
manifest edited to [1, 4096, 4096] over 28x28 shards grew a trainer to 20.7 GB before the
kernel killed it; here the sum is compared with a cap the job sets and refused in one line.
Pure arithmetic, no imports of torch: the numbers are the caller's.
"""
import os

PREFETCH = 4  # batches a loader's worker prepares ahead (make_loader's prefetch_factor): the ring holds 2 more


def batch_bytes(batch_size, shapes):
    """Bytes of one uint8 batch: every image is padded to 3 channels and to the largest
    height and width over the sources (pipeline.data.batch.Layout). `shapes`: (C, H, W) each."""
    shapes = list(shapes)
    return batch_size * 3 * max(s[1] for s in shapes) * max(s[2] for s in shapes)


def needed(batch_size, shapes, workers, *, prefetch_factor=PREFETCH, window_bytes=0, eval_sources=0):
    """{"batch", "ring", "eval_ring", "trainer", "windows", "total"}: bytes one rank's loaders
    and step may hold. ring: the training loader's workers x (prefetch_factor + 2) batches;
    eval_ring: the same for each evaluation loader, which keeps min(workers, 2) workers;
    trainer: the uint8 batch copied out and its float32 copy (5 bytes a pixel); windows:
    `window_bytes` (what one (rank, worker) holds for one source's shuffle window) per
    source and worker."""
    shapes = list(shapes)
    batch = batch_bytes(batch_size, shapes)
    depth = prefetch_factor + 2
    parts = {"batch": batch, "ring": workers * depth * batch,
             "eval_ring": eval_sources * min(workers, 2) * depth * batch,
             "trainer": 5 * batch, "windows": window_bytes * len(shapes) * max(workers, 1)}
    parts["total"] = sum(v for k, v in parts.items() if k != "batch")
    return parts


def check_budget(batch_size, shapes, workers, cap, *, prefetch_factor=PREFETCH, window_bytes=0, eval_sources=0,
                 fetched_ahead=False):
    """The bytes `needed` gives (its dict) if their total fits in `cap`; else ValueError, one line
    naming the batch's bytes, the workers, the total and the flags that change them.
    `shapes`: {source name: (C, H, W)} as the manifests give them; fetched_ahead: the
    windows' bytes count shards fetched ahead (--fetch-ahead)."""
    parts = needed(batch_size, shapes.values(), workers, prefetch_factor=prefetch_factor,
                   window_bytes=window_bytes, eval_sources=eval_sources)
    if parts["total"] <= cap:
        return parts
    tallest = max(shapes, key=lambda n: shapes[n][1] * shapes[n][2])
    queue = f"{workers} worker(s) x {prefetch_factor + 2} batches queued" if workers else "no workers"
    flags = ["--batch-size", "--workers"] if workers else ["--batch-size"]
    held = ""
    if parts["windows"]:
        windows = ["--shuffle-window", "--fetch-ahead"] if fetched_ahead else ["--shuffle-window"]
        flags = windows + flags if 2 * parts["windows"] > parts["total"] else flags + windows  # the larger part first
        held = f" and the shuffle windows{' and shards fetched ahead' if fetched_ahead else ''} " \
               f"({human(parts['windows'])})"
    lower = ", ".join(flags[:-1]) + " or " + flags[-1]
    raise ValueError(
        f"--batch-size {batch_size} of 3x{max(s[1] for s in shapes.values())}x{max(s[2] for s in shapes.values())} "
        f"images ({tallest}'s manifest gives shape {list(shapes[tallest])}) is {human(parts['batch'])} a batch; with "
        f"{queue}, the float copy{held} a rank needs "
        f"{human(parts['total'])}, more than --max-batch-memory {human(cap)}: lower {lower}, "
        f"or raise --max-batch-memory")


def default_cap(environ=os.environ):
    """Half of this machine's physical memory, shared by the ranks torchrun starts on it
    (LOCAL_WORLD_SIZE; 1 without torchrun)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical // 2 // local_world_size(environ)


def local_world_size(environ=os.environ):
    """The processes torchrun started on this machine (LOCAL_WORLD_SIZE), 1 when unset or not a number."""
    try:
        return max(1, int(environ.get("LOCAL_WORLD_SIZE", 1)))
    except ValueError:
        return 1


def human(n):
    """12345678 -> '11.8 MiB' (powers of 1024, as --max-batch-memory's suffixes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
