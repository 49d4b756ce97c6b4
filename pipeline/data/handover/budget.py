"""What a job's batches may take in memory, from the job's own numbers, before anything is read.

A manifest's `shape` and the command line's --batch-size decide how large a batch is, and
the loader multiplies it: every loader worker (or, without workers, the loader itself) keeps
(prefetch_factor + 2) batches in its ring (pipeline.data.handover.ring), the trainer makes a float32
copy of each batch it steps on, each process that decodes holds a batch's images as decoded,
stacked and padded, each (rank, worker) holds a shuffle window per source, and a model
trained on the CPU keeps its activations for the backward pass. A manifest edited to
[1, 4096, 4096] over 28x28 shards grew a trainer to 20.7 GB before the kernel killed it (and
past 4 GB at --batch-size 1 without workers, when only the queue was counted); here the sum
is compared with a cap the job sets and refused in one line. Pure arithmetic, no imports of
torch: the numbers are the caller's.
"""
import os

from pipeline.data.decoding import image_caps

PREFETCH = 4  # batches a loader's worker prepares ahead (make_loader's prefetch_factor): the ring holds 2 more


def batch_bytes(batch_size, shapes):
    """Bytes of one uint8 batch: every image is padded to 3 channels and to the largest
    height and width over the sources (pipeline.data.fields.batch.Layout). `shapes`: (C, H, W) each."""
    shapes = list(shapes)
    return batch_size * 3 * max(s[1] for s in shapes) * max(s[2] for s in shapes)


def needed(batch_size, shapes, workers, *, prefetch_factor=PREFETCH, window_bytes=0, eval_sources=0, step_bytes=0,
           fields=None):
    """{"batch", "ring", "eval_ring", "decode", "trainer", "windows", "step", "total"}: bytes one
    rank's loaders and step may hold. ring: the training loader's workers (1 without) x
    (prefetch_factor + 2) batches; eval_ring: the same for each evaluation loader, which keeps
    min(workers, 2) workers;
    decode: in each process that decodes (every worker, or the trainer itself without workers),
    a batch's images as decoded, joined into one array and padded to the batch's height and
    width (decode.decode_batch, columns.to_canvas: four arrays' worth of a batch's bytes, as colour
    JPEGs decode as RGBX, 4/3 of their batch, in the first two: decoding.rgbx), and
    one image being resized: the source image as decoded (at most image_caps.MAX_DECODE_RATIO
    times the target's pixels, 4 bytes each), the resized image, its array and its CHW copy
    (3 images of the target's size); trainer: the uint8 batch copied out and its float32 copy
    (5 bytes a pixel); windows: `window_bytes` (what one (rank, worker) holds for one source's
    shuffle window) per source and worker; step: the caller's `step_bytes`, what the model's
    step holds (the trainer counts it on the CPU). fields: (bytes of a batch with every field at its
    cap, bytes of its largest image field) of a stream of fields (batch.Layout.memory), in
    place of the image batch the shapes make."""
    shapes = list(shapes)
    batch = batch_bytes(batch_size, shapes) if fields is None else fields[0]
    depth = prefetch_factor + 2
    decoders = max(workers, 1) + eval_sources * min(workers, 2)
    image = batch_bytes(1, shapes) if fields is None else fields[1]
    source = 4 * min(image_caps.MAX_PIXELS, image_caps.MAX_DECODE_RATIO * image // 3)
    parts = {"batch": batch, "ring": max(workers, 1) * depth * batch,
             "eval_ring": eval_sources * max(min(workers, 2), 1) * depth * batch,
             "decode": decoders * (4 * batch + 3 * image + source),
             "trainer": 4 * batch, "windows": window_bytes * len(shapes) * max(workers, 1), "step": step_bytes}
    parts["total"] = sum(v for k, v in parts.items() if k != "batch")
    return parts


def check_budget(batch_size, shapes, workers, cap, *, prefetch_factor=PREFETCH, window_bytes=0, eval_sources=0,
                 fetched_ahead=False, step_bytes=0, width=None, fields=None):
    """The bytes `needed` gives (its dict) if their total fits in `cap`; else ValueError, one line
    naming the batch's bytes, the workers, the total and the flags that would lower it (not
    --batch-size at 1, nor --workers at 0). `shapes`: {source name: (C, H, W)} as the manifests
    give them; fetched_ahead: the windows' bytes count shards fetched ahead (--fetch-ahead);
    step_bytes: the model's step, at --width `width`."""
    parts = needed(batch_size, shapes.values(), workers, prefetch_factor=prefetch_factor,
                   window_bytes=window_bytes, eval_sources=eval_sources, step_bytes=step_bytes, fields=fields)
    if parts["total"] <= cap:
        return parts
    if fields is not None:
        raise ValueError(f"--batch-size {batch_size} of every field at its cap is {human(parts['batch'])} a batch; "
                         f"with {f'{workers} worker(s)' if workers else 'no workers'}, decoding and the shuffle windows "
                         f"a rank needs {human(parts['total'])}, more than the cap {human(cap)}: lower the batch size, "
                         f"the workers or the fields' caps (max_bytes, shape, size), or raise the cap")
    tallest = max(shapes, key=lambda n: shapes[n][1] * shapes[n][2])
    queue = f"{workers} worker(s) x {prefetch_factor + 2} batches queued" if workers else "no workers"
    flags = (["--batch-size"] if batch_size > 1 else []) + (["--workers"] if workers else [])
    held = ["decoding", "the float copy"]
    if parts["step"]:
        flags = ["--width"] + flags if 2 * parts["step"] > parts["total"] else flags + ["--width"]
        held.append(f"the model's step at --width {width} on the CPU ({human(parts['step'])})")
    if parts["windows"]:
        windows = ["--shuffle-window", "--fetch-ahead"] if fetched_ahead else ["--shuffle-window"]
        flags = windows + flags if 2 * parts["windows"] > parts["total"] else flags + windows  # the larger part first
        held.append(f"the shuffle windows{' and shards fetched ahead' if fetched_ahead else ''} "
                    f"({human(parts['windows'])})")
    raise ValueError(
        f"--batch-size {batch_size} of 3x{max(s[1] for s in shapes.values())}x{max(s[2] for s in shapes.values())} "
        f"images ({tallest}'s manifest gives shape {list(shapes[tallest])}) is {human(parts['batch'])} a batch; with "
        f"{queue}, {_listed(held)} a rank needs {human(parts['total'])}, more than --max-batch-memory {human(cap)}: "
        + (f"lower {_listed(flags, 'or')}, or raise --max-batch-memory" if flags else
           "raise --max-batch-memory, or give the source a manifest of a smaller shape"))


def _listed(items, last="and"):
    """['a', 'b', 'c'] -> 'a, b and c'."""
    return ", ".join(items[:-1]) + f" {last} " + items[-1] if len(items) > 1 else items[0]


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
