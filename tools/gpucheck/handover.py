"""The loader's hand-over to the device, case by case: a batch must never be overwritten while a
copy still reads it, whoever makes the copy and on whichever stream or thread.

Each case reads the synthetic shards for a few epochs, keeps what it was handed, and compares
every kept sample's bytes (image and label) with those a plain pass at 0 workers read (the
reference: a key's sample is the same in every epoch), and every epoch's keys with the
reference's. The cases take a device: on "cuda" they are what `make gpu-check` runs; on "cpu"
the same code runs in tests/test_gpu_check.py (what can run without CUDA). On CUDA a user's copy
is queued behind DELAY_CYCLES of GPU work, so a slot released before the copy has run is
overwritten by its worker meanwhile and the bytes differ.
"""
import inspect
import queue
import threading
import time
import warnings
from contextlib import nullcontext

import torch

from gpucheck.data import BATCH, SHAPES, train_sources
from gpucheck.runner import Failed
from pipeline.data.streams.stream import MixedStream
from pipeline.data.handover.loader import make_loader

DELAY_CYCLES = 20_000_000  # GPU clock cycles (about 10 ms) queued before each copy a user makes
EPOCH_BATCHES = 40  # batches an epoch, at the check's batch size


def has_device():
    """Whether make_loader copies batches to a device itself (`device=`)."""
    return "device" in inspect.signature(make_loader).parameters


def host_loader(stream, workers):
    """make_loader's CPU batches, page-locked where the loader offers it (`pin_memory`)."""
    pin = {"pin_memory": True} if "pin_memory" in inspect.signature(make_loader).parameters else {}
    return make_loader(stream, workers, **pin)


def case_stream(folder, batch):
    return MixedStream(train_sources(folder), dict.fromkeys(SHAPES, 1.0), batch, epoch_samples=batch * EPOCH_BATCHES,
                       normalize=False)


def reference(folder, batch, epochs):
    """({key: (image, label)}, [sorted keys of each epoch]) from plain passes at 0 workers, each
    batch copied out as it arrives."""
    ms = case_stream(folder, batch)
    loader = make_loader(ms, 0)
    samples, keys = {}, []
    for e in range(epochs):
        ms.set_epoch(e)
        seen = []
        for b in loader:
            for i, k in enumerate(b["key"]):
                samples[k] = (b["image"][i].clone(), int(b["label"][i]))
            seen += list(b["key"])
        keys.append(sorted(seen))
    loader.close()
    return samples, keys


def verdict(what, held, folder, batch, epochs, device):
    """Compare what a case kept, [(epoch, keys, [(image, label), ...])] (a batch, its copies), with
    the reference: figures, or Failed naming how many samples differ and which epochs lost or
    repeated keys."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples, want = reference(folder, batch, epochs)
    differ = rows = 0
    got = [[] for _ in range(epochs)]
    for epoch, keys, copies in held:
        for image, label in copies:
            image, label = image.cpu(), label.cpu()
            for i, k in enumerate(keys):
                ref_image, ref_label = samples.get(k, (None, None))
                differ += ref_image is None or not torch.equal(image[i], ref_image) or int(label[i]) != ref_label
            rows += len(keys)
        got[epoch] += keys
    wrong_epochs = [e + 1 for e in range(epochs) if sorted(got[e]) != want[e]]
    figures = {"samples": rows, "batches": len(held), "differ": differ, "epochs_with_other_keys": wrong_epochs,
               "summary": f"{what}: {rows} samples in {len(held)} kept batches over {epochs} epochs, bytes compared: "
                          f"{differ} differ"}
    if differ or wrong_epochs:
        raise Failed(f"{differ} of {rows} kept samples differ from what was read"
                     + (f"; epochs {wrong_epochs} hold other keys than a plain pass" if wrong_epochs else ""), figures)
    return figures


def busy(device):
    """GPU work queued on the current stream, so the host runs ahead of the device."""
    if device.type == "cuda":
        torch.cuda._sleep(DELAY_CYCLES)


def kept_on_device(folder, device, workers, batch=BATCH, epochs=3):
    """make_loader(device=): every batch of `epochs` epochs kept (on the device), the consumer's
    stream kept busy after each."""
    return verdict(f"device= at {workers} workers", keep_all(folder, device, workers, batch, epochs, busy),
                   folder, batch, epochs, device)


def keep_all(folder, device, workers, batch, epochs, after=None):
    """[(epoch, keys, [(image, label)])] of every batch of `epochs` epochs through
    make_loader(device=), all kept; `after(device)` runs after each batch is taken."""
    ms = case_stream(folder, batch)
    loader = make_loader(ms, workers, device=device)
    held = []
    for e in range(epochs):
        ms.set_epoch(e)
        for b in loader:
            held.append((e, list(b["key"]), [(b["image"], b["label"])]))
            if after is not None:
                after(device)
    loader.close()
    return held


def kept_views(folder, device, workers, batch=BATCH, epochs=3):
    """The loader's CPU batches (no device=), every one of `epochs` epochs kept as handed out,
    each also copied to the device on the current (default) stream with non_blocking=True, as
    a loop of the user's own does: the kept views and the copies compared."""
    ms = case_stream(folder, batch)
    loader = host_loader(ms, workers)
    held = []
    for e in range(epochs):
        ms.set_epoch(e)
        for b in loader:
            held.append((e, list(b["key"]), [(b["image"], b["label"]), copy(b, device)]))
            busy(device)
    loader.close()
    return verdict(f"CPU views kept, copies on the default stream, {workers} workers", held, folder, batch, epochs,
                   device)


def copy(b, device):
    """The batch's image and label copied to `device` without waiting (a new tensor on a CPU too)."""
    return tuple(b[k].to(device, non_blocking=True, copy=True) for k in ("image", "label"))


def side_stream_dropped(folder, device, workers, batch=BATCH, epochs=3):
    """The user's own copy of the loader's CPU batches: each copied on a side stream behind queued
    GPU work with non_blocking=True, the CPU batch dropped at once, and no stream waits on the
    side stream until the end."""
    ms = case_stream(folder, batch)
    loader = host_loader(ms, workers)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    held = []
    for e in range(epochs):
        ms.set_epoch(e)
        for b in loader:
            keys = list(b["key"])
            with torch.cuda.stream(side) if side is not None else nullcontext():
                busy(device)
                image, label = copy(b, device)
            del b  # before any stream waits on `side`
            held.append((e, keys, [(image, label)]))
    loader.close()
    return verdict(f"side stream, dropped before any wait, {workers} workers", held, folder, batch, epochs, device)


def from_thread(folder, device, workers, batch=BATCH, epochs=3):
    """The loader read in this thread, each CPU batch copied and dropped in another thread (on a
    stream of its own behind queued GPU work): the batch's last reference goes there, and with
    it the slot's release."""
    ms = case_stream(folder, batch)
    loader = host_loader(ms, workers)
    handed, held, failed = queue.Queue(maxsize=2), [], []

    def copier():
        try:
            side = torch.cuda.Stream(device) if device.type == "cuda" else None
            while (item := handed.get()) is not None:
                e, b = item
                keys = list(b["key"])
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    busy(device)
                    image, label = copy(b, device)
                del b, item
                held.append((e, keys, [(image, label)]))
        except BaseException as ex:  # noqa: BLE001 - reported by the main thread
            failed.append(ex)
            while handed.get() is not None:  # let the reader finish
                pass

    thread = threading.Thread(target=copier, name="copier")
    thread.start()
    try:
        for e in range(epochs):
            ms.set_epoch(e)
            for b in loader:
                handed.put((e, b))
                del b
    finally:
        handed.put(None)
        thread.join()
        loader.close()
    if failed:
        raise failed[0]
    return verdict(f"copied and dropped in a thread, {workers} workers", held, folder, batch, epochs, device)


def workers_restarted(folder, device, workers=2, batch=BATCH, epochs=2):
    """make_loader(device=) started (its ring registered for the copy where CUDA is), a pass, then
    close(): the workers end, and the next pass starts them again from a process whose ring
    is registered. Every pass's batches kept and compared."""
    ms = case_stream(folder, batch)
    loader = make_loader(ms, workers, device=device).start()
    held = []
    for e in range(epochs):
        ms.set_epoch(e)
        for b in loader:
            held.append((e, list(b["key"]), [(b["image"], b["label"])]))
        loader.close()
    return verdict(f"workers started again after close(), {workers} workers", held, folder, batch, epochs, device)


def refused_page_lock(folder, device, workers=2, batch=BATCH, epochs=1):
    """cudaHostRegister refused (as a container's memlock limit refuses it), simulated by
    pipeline.data.handover.ring._register answering False: one warning of one line, and the batches
    still arrive whole (a pinned fallback)."""
    from pipeline.data.handover import ring

    if not hasattr(ring, "_register"):
        raise Failed("pipeline.data.handover.ring has no _register to refuse: point this case at the loader's page-lock call")
    real, ring._register = ring._register, lambda memory: False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = keep_all(folder, device, workers, batch, epochs)
    finally:
        ring._register = real
    said = [str(c.message) for c in caught if any(w in str(c.message).lower() for w in ("lock", "pin", "regist"))]
    figures = verdict("page-lock refused", held, folder, batch, epochs, device)
    figures.update(warnings=said, summary=f"{figures['summary']}; warned: {said[0] if said else 'nothing'}")
    if len(said) != 1 or "\n" in said[0]:
        raise Failed(f"{len(said)} warnings about the refused page-lock, one of one line expected", figures)
    return figures


def loader_rate(folder, device, workers=(0, 2, 4), batches=200):
    """The trainer's data path to one GPU at each worker count: make_loader(device=), the batch
    normalised there, then a forward and backward pass of the recipe's model so that the copy
    has a step to overlap. Figures: samples/s and the share of the loop's time spent waiting for
    the loader; the first batch (workers starting) is not timed."""
    from pipeline.train.model import Net
    from pipeline.train.run import autocast

    runs, problems, model = [], [], None
    for w in workers:
        ms = MixedStream(train_sources(folder), dict.fromkeys(SHAPES, 1.0), BATCH,
                         epoch_samples=(batches + 1) * BATCH, shuffle_buffer=2000, normalize=False)
        model = model or Net(ms.layout.num_classes, 64).to(device)
        loader = make_loader(ms, w, device=device)
        ms.set_epoch(0)
        it = iter(loader)
        next(it)
        wait, got, elsewhere, finite = 0.0, 0, 0, True
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        while True:
            t = time.perf_counter()
            batch = next(it, None)
            wait += time.perf_counter() - t
            if batch is None:
                break
            x, y, s = (batch[k] for k in ("image", "label", "source"))
            elsewhere += x.device != device
            with autocast(device):
                loss = torch.nn.functional.cross_entropy(model(ms.layout.normalize(x, s)).float(), y)
            loss.backward()
            finite &= bool(torch.isfinite(loss))  # waits for the GPU: copy, normalisation and step are timed
            got += 1
        elapsed = time.perf_counter() - start
        loader.close()
        rate = got * BATCH / elapsed
        runs.append({"workers": w, "batches": got, "samples_per_s": round(rate, 1),
                     "wait_share": round(wait / elapsed, 4), "batches_elsewhere": elsewhere})
        if got != batches or elsewhere or not finite:
            problems.append(f"workers {w}: {got} of {batches} batches, {elsewhere} not on {device}, finite {finite}")
    figures = {"runs": runs, "summary": "; ".join(f"{r['workers']} workers {r['samples_per_s']:,.0f} samples/s, "
                                                  f"waited {r['wait_share']:.1%}" for r in runs)}
    if problems:
        raise Failed("; ".join(problems), figures)
    return figures


def cases(device, workers):
    """(name, function(folder)) of every hand-over case, in the order the check runs them."""
    return [(f"kept batches, device= at {w} workers", lambda f, w=w: kept_on_device(f, device, w))
            for w in (0, workers)] + [
        (f"kept batches, CPU views and copies on the default stream at {w} workers",
         lambda f, w=w: kept_views(f, device, w)) for w in (0, workers)] + [
        ("kept batches, side stream dropped before any wait", lambda f: side_stream_dropped(f, device, workers)),
        ("kept batches, copied from a thread", lambda f: from_thread(f, device, workers)),
        ("workers started again after the ring was registered", lambda f: workers_restarted(f, device)),
        ("page-lock refused", lambda f: refused_page_lock(f, device)),
    ]
