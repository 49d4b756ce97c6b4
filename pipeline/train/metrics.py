"""What a run writes as it goes: metrics.jsonl, the per-rank key logs, and the per-step sums
between two metrics lines.

Every line is written whole (a write cut short by a full disk is cut back off), and
on resume a torn last line is dropped and lines past the checkpoint go, so a resumed
run's files read as if it had never stopped.
"""
import json
import os
import time
import warnings

import torch

from pipeline.train import dist
from pipeline.files import append_line, cut_to_complete_lines, keep_lines


class Metrics:
    """metrics.jsonl, written by rank 0 only."""

    def __init__(self, path, enabled, resume_step=None):
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None:
            lines = cut_to_complete_lines(path)
            kept = []
            for i, ln in enumerate(lines):
                step, problem = _step_of(ln)
                if problem:  # damaged by hand, not by us: what follows cannot be trusted either
                    warnings.warn(f"{path}: line {i + 1} {problem}; it and the {len(lines) - i - 1} line(s) after it "
                                  f"are dropped on resume", stacklevel=2)
                    break
                if step > resume_step or (step == resume_step and json.loads(ln).get("kind") == "stopped"):
                    break
                kept.append(ln)
            if kept != lines:
                keep_lines(path, kept)

    def log(self, **record):
        if self.enabled:
            append_line(self.path, json.dumps(record))


def _step_of(line):
    """(the step a metrics line records, None) or (None, what is wrong with it)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None, "is not valid JSON"
    if not isinstance(record, dict):
        return None, "is not a JSON object"
    step = record.get("step", 0)
    if type(step) is not int:
        return None, f"has step {json.dumps(step)[:40]}, not a whole number"
    return step, None


class KeyLog:
    """keys-rank<R>.txt: "<epoch>\\t<key>" for every training sample this rank consumed, in order."""

    def __init__(self, folder, rank, keep=None):
        self.path = os.path.join(folder, f"keys-rank{rank}.txt")
        self.count, self.pending = 0, []
        if keep is not None:
            truncate_keys(self.path, keep)
            self.count = keep

    def add(self, epoch, keys):
        self.pending += [f"{epoch}\t{k}\n" for k in keys]
        self.count += len(keys)

    def flush(self):
        if self.pending:
            with open(self.path, "a") as f:
                f.writelines(self.pending)
            self.pending = []


def truncate_keys(path, n):
    """Keep the first n lines of a key log (keys consumed past a checkpoint go)."""
    if os.path.exists(path):
        lines = cut_to_complete_lines(path)
        if len(lines) != n:
            keep_lines(path, lines[:n])


class StepLog:
    """Per-source loss, sample counts and skipped samples between two metrics lines.

    Loss sums stay on the device and sample counts on the CPU (counted from the batch
    before it is copied), so this log adds no wait for the device to a step (the one wait
    a step has is the non-finite check, run.nonfinite_counts); both are all-reduced once
    per line. `shared()` all-reduces the partial sums for a checkpoint; resuming puts
    them on rank 0 only, which the next all-reduce turns into the same line on any
    world size.
    """

    def __init__(self, names, device):
        self.names, self.device = names, device
        self.loss = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.counts = torch.zeros(len(names) + 1, dtype=torch.float64)  # last: skipped samples
        self.t = time.perf_counter()

    def add(self, losses, source, counts, skipped):
        """losses and source on the device; counts (samples per source) and skipped on the CPU."""
        self.loss.index_add_(0, source, losses.double())
        self.counts[:-1] += counts
        self.counts[-1] += skipped

    def _zero(self):
        self.loss.zero_()
        self.counts.zero_()

    def _reduced(self):
        both = dist.all_reduce_sum(torch.cat([self.loss, self.counts.to(self.device)]))
        return both.cpu().tolist()

    def shared(self, is_main):
        """The partial sums over all ranks (a collective); afterwards rank 0 holds them alone."""
        total = self._reduced()
        self._zero()
        self.restore(total, is_main)
        return total

    def restore(self, sums, is_main):
        if is_main and sums is not None:
            n = len(self.names)
            self.loss.copy_(torch.tensor(sums[:n], dtype=torch.float64))
            self.counts.copy_(torch.tensor(sums[n:], dtype=torch.float64))

    def flush(self):
        """All-reduce and reset; returns the fields of one metrics line."""
        total = self._reduced()
        n = len(self.names)
        loss_sum, count, skipped = total[:n], total[n:2 * n], int(total[2 * n])
        dt = time.perf_counter() - self.t
        self._zero()
        self.t = time.perf_counter()
        seen = sum(count)
        return {"loss": {k: a / max(c, 1) for k, a, c in zip(self.names, loss_sum, count)},
                "samples_per_s": round(seen / dt, 1),
                "share": {k: c / max(seen, 1) for k, c in zip(self.names, count)}, "skipped": skipped}
