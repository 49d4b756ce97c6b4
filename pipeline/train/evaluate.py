"""Evaluation: exact accuracy per --eval source (and per class), and the lines that report it.

Apart from the epoch loop because it has its own rule for collectives: ranks hold
different numbers of test batches, so nothing is exchanged until the final sums.
"""
import os

import torch
import torch.nn.functional as F

from pipeline import stream
from pipeline.errors import InputError, redact
from pipeline import cli
from pipeline.files import write_json_atomic
from pipeline.train import checkpoint, dist
from pipeline.train.run import autocast

PER_CLASS_MAX = 20  # sources with at most this many classes are evaluated per class (a confusion matrix each)
ORIGINS = {"synthetic": "synthetic look-alike data", "torchvision": "real data, torchvision files",
           "imagefolder": "real data, an ImageFolder", "index": "an indexed WebDataset"}


def origin_label(source):
    return ORIGINS.get(source.origin.get("kind"), "origin not recorded")


def evaluate(run, loaders):
    """Exact per-source accuracy: every test sample counted once over all ranks; per class
    too, with a confusion matrix, for sources of up to PER_CLASS_MAX classes.

    Ranks may hold different numbers of test batches, so the forward pass uses the
    plain module (DDP's forward can broadcast buffers, a collective) and only the
    final sums are all-reduced, once.
    """
    model, device = run.model, run.device
    dist.sync_buffers(model)
    model.eval()
    sums = torch.zeros(len(loaders), 4, dtype=torch.float64, device=device)  # count, correct, loss, skipped
    sizes = [len(ev.source.classes) for ev in run.evals]
    # rows: true class; columns: predicted class of the same source, the last one any other source's class
    confusions = [torch.zeros(k, k + 1, dtype=torch.float64, device=device) if k <= PER_CLASS_MAX else None
                  for k in sizes]
    with torch.no_grad():
        for i, loader in enumerate(loaders):
            offset, k = run.layout.offsets[run.layout.index(run.evals[i].source.name)], sizes[i]
            for batch in loader:
                sums[i, 3] += batch["skipped"]
                if len(batch["label"]) == 0:
                    continue
                x, y, s = batch["image"], batch["label"], batch["source"]  # on the device (make_loader's device)
                with autocast(device):
                    logits = model(run.layout.normalize(x, s)).float()
                predicted = logits.argmax(1)
                sums[i, 0] += len(y)
                sums[i, 1] += (predicted == y).sum()
                sums[i, 2] += F.cross_entropy(logits, y, reduction="sum")
                if confusions[i] is not None:
                    column = predicted - offset
                    column = torch.where((column >= 0) & (column < k), column, k)
                    confusions[i] += torch.bincount((y - offset) * (k + 1) + column,
                                                    minlength=k * (k + 1)).view(k, k + 1).to(torch.float64)
    flat = torch.cat([sums.flatten()] + [c.flatten() for c in confusions if c is not None])
    dist.all_reduce_sum(flat)  # one collective for every count
    sums, at = flat[:sums.numel()].view_as(sums), sums.numel()
    for i, c in enumerate(confusions):
        if c is not None:
            confusions[i], at = flat[at:at + c.numel()].view_as(c), at + c.numel()
    model.train()
    out = {}
    for ev, row, confusion in zip(run.evals, sums.tolist(), confusions):
        n, correct, loss, skipped = row
        out[ev.source.name] = {"count": int(n), "correct": int(correct), "accuracy": correct / max(n, 1),
                               "loss": loss / max(n, 1), "skipped": int(skipped), "data": origin_label(ev.source),
                               "manifest": redact(ev.source.manifest)}
        if confusion is not None:
            counts = confusion.round().to(torch.int64).tolist()
            out[ev.source.name]["per_class"] = class_accuracies(ev.source.classes, counts)
            out[ev.source.name]["confusion"] = counts
    return out


def class_accuracies(classes, confusion):
    """Per class, the share of its test samples predicted right; None (null in summary.json) for
    a class with no test samples: it was not measured, which 0 would misreport."""
    return {name: row[j] / sum(row) if sum(row) else None for j, (name, row) in enumerate(zip(classes, confusion))}


def per_class_lines(evals, digits=3):
    """'  NAME per class: airplane 0.950, cat n/a, ...' for each source evaluated per class
    (n/a: no test samples of that class), and where most of its test samples were predicted as
    another source's classes, how many: a small source's 0.000 after one epoch was that, and
    only metrics.jsonl's confusion matrix said so."""
    return [f"  {k} per class: " + ", ".join(f"{cli.printable(c)} {'n/a' if a is None else f'{a:.{digits}f}'}"
                                             for c, a in v["per_class"].items()) + elsewhere(v.get("confusion"))
            for k, v in evals.items() if "per_class" in v]


def elsewhere(confusion):
    """' (12 of 12 predicted as another source's class)' where most of a source's test samples were
    (the confusion matrix's last column), else ''."""
    total = sum(map(sum, confusion or []))
    other = sum(row[-1] for row in confusion or [])
    return f" ({other:,} of {total:,} predicted as another source's class)" if total and 2 * other > total else ""


def epoch_line(epoch, epochs, evals):
    """'epoch 1/2: mnist 0.9812 (shards/mnist-test.json, real data, torchvision files), ...': each
    accuracy says which data it was measured on, and over how many samples where some were skipped
    (damaged), so a log read later needs no other file."""
    def over(v):
        skipped = v.get("skipped", 0)
        return f", over {v['count']:,} samples, {skipped:,} skipped" if skipped else ""

    return f"epoch {epoch + 1}/{epochs}: " + ", ".join(
        f"{k} {v['accuracy']:.4f} ({v['manifest']}, {v['data']}{over(v)})" for k, v in evals.items())


def eval_loaders(run):
    """One loader per test source, made once: their workers persist between evaluations
    (at most 2 each, idle while training runs)."""
    device = run.device if run.device.type == "cuda" else None  # on the CPU the views themselves
    return [stream.make_loader(ev, min(run.args.workers, 2), device=device, memory_format=memory_format(run.args),
                               timeout=getattr(run.args, "loader_timeout", 0) or None) for ev in run.evals]


def memory_format(args):
    """The image batches' layout for make_loader: channels-last with --channels-last, as the model is."""
    return "channels_last" if getattr(args, "channels_last", False) else "contiguous"


def evaluate_only(run):
    path = os.path.join(run.args.out, "checkpoint.pt")
    if not os.path.exists(path):
        raise InputError(f"--eval-only: no checkpoint at {path}")
    try:
        state = checkpoint.load(path, run.device)
        checkpoint.check_resume(checkpoint.fingerprint_of(state, path), run.fingerprint,
                                only=checkpoint.MODEL_FIELDS, what="--eval-only")
        checkpoint.load_model(run.model, state, path)
    except InputError:
        raise
    except ValueError as e:  # the checkpoint's checks: a bad file, not a bug
        raise InputError(str(e)) from e
    evals = evaluate(run, eval_loaders(run))
    if run.topo.is_main:
        write_json_atomic(os.path.join(run.args.out, "eval.json"), {"eval": evals, "world_size": run.topo.world})
        print(", ".join(f"{k} {v['accuracy']:.4f} ({v['count']} samples, {v['data']})" for k, v in evals.items()))
        for line in per_class_lines(evals):
            print(line)
    return evals
