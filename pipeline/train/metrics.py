"""What a run writes as it goes: metrics.jsonl, the per-rank key logs, and the per-step sums
between two metrics lines.

Every line is written whole (a write cut short by a full disk is cut back off), and
on resume a torn last line is dropped and lines past the checkpoint go, so a resumed
run's files read as if it had never stopped.
"""
import json
import os
import re
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
    """keys-rank<R>.txt: "<epoch>\\t<key>" for every training sample this rank consumed, in order
    (a key that could read as more than one line, or starts with '"', as a JSON string: `key_line`)."""

    def __init__(self, folder, rank, keep=None):
        self.path = os.path.join(folder, f"keys-rank{rank}.txt")
        self.count, self.pending = 0, []
        if keep is not None:
            if keep and not os.path.exists(self.path):  # deleted since the checkpoint: say so, go on
                warnings.warn(f"{self.path}: not there, though the checkpoint counts {keep} key line(s) in it; the "
                              f"key log starts again here and lacks the keys trained before", stacklevel=2)
            truncate_keys(self.path, keep)
            self.count = keep

    def add(self, epoch, keys):
        self.pending += [key_line(epoch, k) for k in keys]
        self.count += len(keys)

    def flush(self):
        """The pending lines appended whole, or none of them (files.append_line: a full disk named)."""
        if self.pending:
            append_line(self.path, "".join(self.pending))
            self.pending = []


# every character str.splitlines (and so many a reader) ends a line at; '"' first marks a JSON key
_NOT_PLAIN = re.compile('^"|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]')


def key_line(epoch, key):
    """A key log's line: the key as it is, or as a JSON string (ASCII) where it holds a line
    break of any kind or starts with '"', so that every line is one sample, however read."""
    return f"{epoch}\t{json.dumps(key) if _NOT_PLAIN.search(key) else key}\n"


def read_keys(path):
    """[(epoch, key)] of a key log, in order: lines end at "\\n" only, a key starting with '"' is JSON."""
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")[:-1]
    out = []
    for ln in lines:
        epoch, key = ln.split("\t", 1)
        out.append((int(epoch), json.loads(key) if key.startswith('"') else key))
    return out


def truncate_keys(path, n):
    """Keep the first n lines of a key log (keys consumed past a checkpoint go)."""
    if os.path.exists(path):
        lines = cut_to_complete_lines(path)
        if len(lines) != n:
            keep_lines(path, lines[:n])


class StepLog:
    """What the steps between two reads of the device hold: per-source loss sums and sample
    counts of the trained steps, the samples skipped as damaged, and per step the samples
    whose loss was not finite and whether the step was skipped (its `found` flag).

    Everything stays on the device until `reduce`, the one place the steps wait for it: one
    all-reduce of all of it, with the ranks' stop votes, read once, at a metrics line or a
    checkpoint (every --log-every steps at most). Afterwards rank 0 holds the partial sums
    alone, which the next reduce turns into the same line on any world size, so a
    checkpoint can carry them (`restore` on resume).
    """

    def __init__(self, names, device, is_main=True):
        self.names, self.device, self.is_main = names, device, is_main
        n = len(names)
        self.sums = torch.zeros(2 * n, dtype=torch.float64, device=device)  # loss sums, then sample counts
        self.skipped = 0  # damaged samples (a count from the CPU)
        self.rows = []  # (step, per-source non-finite losses then the step's found flag) on the device
        self.t = time.perf_counter()

    def add(self, step, losses, source, found):
        """losses and source of one step and its found flag, on the device: no wait for it."""
        n = len(self.names)
        keep = found == 0
        self.sums[:n].index_add_(0, source, torch.where(keep, losses, 0.0).double())
        self.sums[n:].index_add_(0, source, keep.double().expand(len(source)))
        row = torch.zeros(n + 1, dtype=torch.float64, device=self.device)
        row[:n].index_add_(0, source, (~torch.isfinite(losses)).double())
        row[n] = found
        self.rows.append((step, row))

    def reduce(self, votes=()):
        """Sum everything over the ranks and read it (a collective, and the wait for the device):
        returns (sums: per-source loss sums and counts then skipped samples, as a checkpoint keeps
        them; skipped steps: [(step, {source: non-finite samples})]; the summed votes)."""
        n = len(self.names)
        rows = torch.stack([r for _, r in self.rows]).flatten() if self.rows else self.sums[:0]
        extra = torch.tensor([float(self.skipped), *votes], dtype=torch.float64).to(self.device, non_blocking=True)
        total = dist.all_reduce_sum(torch.cat([self.sums, extra, rows])).cpu().tolist()
        sums = total[:2 * n] + [int(total[2 * n])]
        voted = total[2 * n + 1:2 * n + 1 + len(votes)]
        flat = total[2 * n + 1 + len(votes):]
        skipped_steps = [(step, {k: int(c) for k, c in zip(self.names, flat[i * (n + 1):i * (n + 1) + n]) if c})
                         for i, (step, _) in enumerate(self.rows) if flat[i * (n + 1) + n] > 0]
        self.rows = []
        self.restore(sums, self.is_main)
        return sums, skipped_steps, voted

    def restore(self, sums, is_main):
        """Partial sums (from `reduce`, or a checkpoint) held by rank 0 alone."""
        n = len(self.names)
        self.sums.zero_()
        self.skipped = 0
        if is_main and sums is not None:
            self.sums.copy_(torch.tensor(sums[:2 * n], dtype=torch.float64))
            self.skipped = int(sums[2 * n])

    def line(self, sums):
        """The fields of one metrics line from reduced sums; the sums start again from zero."""
        n = len(self.names)
        loss_sum, count, skipped = sums[:n], sums[n:2 * n], int(sums[2 * n])
        dt = time.perf_counter() - self.t
        self.restore(None, False)
        self.t = time.perf_counter()
        seen = sum(count)
        return {"loss": {k: a / max(c, 1) for k, a, c in zip(self.names, loss_sum, count)},
                "samples_per_s": round(seen / dt, 1),
                "share": {k: c / max(seen, 1) for k, c in zip(self.names, count)}, "skipped": skipped}
