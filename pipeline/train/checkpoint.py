"""Checkpoints: written whole or not at all, loaded without unpickling code, refused when
they belong to a different run, and read back as data that may have been tampered with.

A checkpoint holds the model, optimiser and RNG states, where the run stands (epoch,
step, samples seen, every rank's stream state, the partial sums of the current
metrics line) and a fingerprint of what must not change across a resume: the
sources in order with their classes and shapes and the digest of each one's shard
list, the model (--model, and --width for the default CNN), seed, epoch samples and
weights (and, recorded but free to change, the batch size and what the learning rate
follows). `check_resume` lists every difference in one line; `trainer_state`,
`load_model` and `load_optimizer` check every number and tensor against the run before
it is used, and the counts against each other (the samples seen are what the epochs'
and the ranks' tallies add up to; a rank's key log holds at most a line per sample it
consumed), each failure one line naming the field.
"""
import io
import json
import math
import os
import pickle
from dataclasses import dataclass

import torch

from pipeline.errors import InputError, ShardError, short
from pipeline.ordering import order, state_format
from pipeline.files import open_regular
from pipeline.train.options import DEFAULT_MODEL

VERSION = 2  # of the checkpoint file (its stream state has its own: pipeline.ordering.state_format.VERSION)


def fingerprint(args, sources, world=1):
    """What a resumed run must share with the run that wrote the checkpoint, and (RECORDED) what
    it may change, which the resume reports: the batch size (the stream re-deals the rest of
    an epoch to any world and batch) and what the learning rate follows."""
    return {
        "sources": [{"name": s.name, "classes": len(s.classes), "shape": list(s.shape)} for s in sources],
        "data": {s.name: {"shards": len(s.urls), "samples": s.total, "listing": s.listing} for s in sources},
        "model": args.model, "width": args.width if args.model == DEFAULT_MODEL else None,  # other models: no width
        "batch_size": args.batch_size, "seed": args.seed,
        "epoch_samples": args.epoch_samples, "weights": [round(w, 12) for w in args.weights],
        "final_weights": [round(w, 12) for w in args.final_weights] if args.final_weights else None,
        "schedule": {"lr": args.lr, "world": world, "epochs": args.epochs,
                     "samples": args.epoch_samples or sum(s.total for s in sources)},
    }


RECORDED = ("batch_size", "schedule")  # in the fingerprint, but free to change on resume


MODEL_FIELDS = ("sources", "model", "width")  # what the model's shape depends on: all --eval-only needs to match


FLAGS = {"batch_size": "--batch-size", "model": "--model", "width": "--width", "seed": "--seed",
         "epoch_samples": "--epoch-samples", "weights": "--weights", "final_weights": "--final-weights",
         "sources": "sources (--train)"}  # as the user typed them


def check_resume(saved, current, allow_weights=False, allow_data=False, only=None, what="--resume"):
    """Raise ValueError listing every field that differs (weights and data only if not allowed;
    `only`: compare just these fields)."""
    diffs = []
    for key in only or sorted((set(saved) | set(current)) - set(RECORDED)):
        if allow_weights and key in ("weights", "final_weights") or allow_data and key == "data":
            continue
        if key == "width" and saved.get("model") != current.get("model"):
            continue  # only the default model has a width: the line on --model says it
        if key == "data":
            diffs += [f"data of {name}: checkpoint {_listing(was)}, now {_listing(now)}"
                      for name, (was, now) in data_changes(saved, current).items()]
        elif saved.get(key) != current.get(key):
            diffs.append(f"{FLAGS.get(key, key)}: checkpoint {_show(saved.get(key))}, now {_show(current.get(key))}")
    if diffs:
        hint = ""
        if not allow_weights and any(d.startswith(("--weights", "--final-weights")) for d in diffs):
            hint += " (pass --change-weights to change the mixture on purpose)"
        if not allow_data and any(d.startswith("data of") for d in diffs):
            hint += " (pass --change-data to resume onto other data behind the same source name on purpose)"
        raise ValueError(f"{what} with other settings than the checkpoint's: " + "; ".join(diffs) + hint)


def data_changes(saved, current):
    """{source: (checkpoint's shard list, this run's)} for every source whose shards differ; none
    for a checkpoint written before shard lists were recorded (`legacy`)."""
    if legacy(saved):
        return {}
    was = saved.get("data")
    was = was if isinstance(was, dict) else {}
    return {name: (was.get(name), now) for name, now in current["data"].items() if was.get(name) != now}


def legacy(saved):
    """A fingerprint from before shard-list digests: its data cannot be compared (a warning says so)."""
    return "data" not in saved


def _listing(d):
    if not (isinstance(d, dict) and isinstance(d.get("listing"), str)):
        return "no shard digest" if d is None else short(d, show=json.dumps)
    return f"{d.get('shards')} shards, {d.get('samples')} samples, listing sha256 {d['listing'][:12]}"


def _show(value):
    if isinstance(value, list) and value and all(isinstance(v, dict) and {"name", "classes", "shape"} <= set(v)
                                                 and isinstance(v["shape"], list) for v in value):
        return "[" + ", ".join(f"{v['name']} {v['classes']} classes {'x'.join(map(str, v['shape']))}"
                               for v in value) + "]"
    return short(value, show=json.dumps)


# ---------------------------------------------------------------- reading one back


@dataclass
class Limits:
    """What the run allows a checkpoint's numbers to be. epoch_samples: the larger of this
    run's epoch and the checkpoint's (they differ only after --change-data)."""

    epochs: int
    epoch_samples: int
    batch_size: int  # the checkpoint's own (its fingerprint's): this run's may differ
    sources: int


class _Fields:
    """Reads a checkpoint's fields, each failure one ValueError naming the file and the field."""

    def __init__(self, path, state):
        self.path, self.state = path, state

    def bad(self, field, problem):
        raise ValueError(f"{self.path}: checkpoint field {field}: {problem} (a damaged or edited checkpoint; "
                         f"resume from another one or start over with --overwrite)")

    def json(self, key):
        if key not in self.state:
            self.bad(key, "missing")
        text = self.state[key]
        if not isinstance(text, str):
            self.bad(key, "a JSON text expected")
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            self.bad(key, f"not valid JSON ({e.__class__.__name__})")

    def integer(self, x, field, lo, hi):
        if type(x) is not int or not lo <= x <= hi:
            self.bad(field, f"{short(x, show=json.dumps)}; an integer in {lo}..{hi} expected")
        return x

    def number(self, x, field, lo=0.0, hi=math.inf, whole=False):
        """A finite int or float in [lo, hi] (a whole number if `whole`: counts in float sums)."""
        ok = type(x) in (int, float) and math.isfinite(x) and lo <= x <= hi and (not whole or x == int(x))
        if not ok:
            self.bad(field, f"{short(x, show=json.dumps)}; a {'whole ' if whole else ''}finite number in {lo}..{hi} expected")
        return x

    def items(self, x, field, n, each):
        if not isinstance(x, list) or len(x) != n:
            self.bad(field, f"{short(x, show=json.dumps)}; a list of {n} expected")
        return [each(v, f"{field}[{i}]") for i, v in enumerate(x)]

    def mapping(self, x, field, keys=()):
        if not isinstance(x, dict):
            self.bad(field, f"{short(x, show=json.dumps)}; an object expected")
        for k in keys:
            if k not in x:
                self.bad(f"{field}.{k}", "missing")
        return x


def epoch_samples_of(saved, now):
    """The larger of this run's epoch and the checkpoint's, from its fingerprint's per-source
    sample counts (the two differ only after --change-data); `now` if it has none."""
    data = saved.get("data")
    counts = [d.get("samples") for d in data.values() if isinstance(d, dict)] if isinstance(data, dict) else []
    if saved.get("epoch_samples") is None and counts and all(type(c) is int and c > 0 for c in counts):
        return max(now, sum(counts))
    return now


def fingerprint_of(state, path):
    """The checkpoint's fingerprint, a dict (ValueError naming the field if it is not one); one
    written before --model existed trained the default model."""
    saved = _Fields(path, state).mapping(_Fields(path, state).json("fingerprint"), "fingerprint")
    return saved if "model" in saved else dict(saved, model=DEFAULT_MODEL)


def trainer_state(state, path, limits):
    """Everything a resume takes from a checkpoint besides the model, optimiser and stream
    internals, each number checked against the run (`limits`) and against the others:
    returns {"world", "epoch", "mid", "step", "seen", "history", "key_counts", "nonfinite",
    and when `mid`: "stream" (the stream's state, checked by MixedStream), "facts", "carried",
    "log_sums"}."""
    f = _Fields(path, state)
    world = f.integer(state.get("world"), "world", 1, state_format.MAX_WORLD)
    pos = f.mapping(f.json("position"), "position", ("epoch", "mid", "step", "seen"))
    history = f.mapping(f.json("history"), "history", ("epochs",))
    epochs = history["epochs"]
    if not isinstance(epochs, list):
        f.bad("history.epochs", f"{short(epochs, show=json.dumps)}; a list expected")
    epoch = pos["epoch"]
    if type(epoch) is not int or epoch != len(epochs):  # one history entry per epoch done
        f.bad("position.epoch", f"{short(epoch, show=json.dumps)}, but the history holds {len(epochs)} finished epoch(s)")
    mid = pos["mid"]
    if not isinstance(mid, bool):
        f.bad("position.mid", f"{short(mid, show=json.dumps)}; true or false expected")
    if mid and epoch >= limits.epochs:
        raise ValueError(f"{path}: the checkpoint stopped inside epoch {epoch + 1}, past --epochs {limits.epochs}; "
                         f"raise --epochs to at least {epoch + 1} to finish it")
    b, samples = limits.batch_size, limits.epoch_samples
    seen = f.integer(pos["seen"], "position.seen", 0, (epoch + mid) * samples)  # an epoch is at most its samples
    step = f.integer(pos["step"], "position.step", epoch, seen)  # each step at least one sample; each epoch a step
    by_rank = {}  # samples each rank consumed, by the run's own counts: what its key log may hold
    # key lines each rank wrote, by the run's tallies (those of earlier worlds too: a rank's key log keeps its
    # lines whatever the world); None where they can't say: a tally that did not count them (an older checkpoint's)
    logged = {}
    for i, e in enumerate(epochs):
        field = f"history.epochs[{i}]"
        f.mapping(e, field, ("epoch", "batches", "skipped", "samples"))
        f.integer(e["epoch"], f"{field}.epoch", i + 1, i + 1)
        f.integer(e["skipped"], f"{field}.skipped", 0, order.MAX_COUNT)
        for r, n in f.mapping(e["batches"], f"{field}.batches").items():
            f.integer(n, f"{field}.batches.{r}", 0, samples)  # at least a sample a batch, whatever the batch size
        for name, ranks in f.mapping(e["samples"], f"{field}.samples").items():
            for r, n in f.mapping(ranks, f"{field}.samples.{name}").items():
                by_rank[r] = by_rank.get(r, 0) + f.integer(n, f"{field}.samples.{name}.{r}", 0, samples)
        if logged is not None and "keys" in e:  # each rank's key log holds its lines of every world it ran in
            for r, n in f.mapping(e["keys"], f"{field}.keys").items():
                logged[r] = logged.get(r, 0) + f.integer(n, f"{field}.keys.{r}", 0, samples)
        else:
            logged = None
        for k, v in f.mapping(e.get("before_resume", {}), f"{field}.before_resume").items():
            logged = _add(by_rank, k, facts(f, v, f"{field}.before_resume.{k}", samples, None, limits.sources), logged)
    for key in ("wait", "busy"):
        if key in history:
            f.number(history[key], f"history.{key}")
    out = {"world": world, "epoch": epoch, "mid": mid, "step": step, "seen": seen, "history": history,
           "nonfinite": f.integer(f.json("nonfinite") if "nonfinite" in state else 0, "nonfinite", 0, step)}
    if mid:
        per_rank = samples // (world * b)
        streams = f.mapping(f.json("stream"), "stream", ("epoch", "ranks"))  # the rest is MixedStream's to check
        f.integer(streams["epoch"], "stream.epoch", epoch, epoch)  # the epoch the position stopped in, not another's
        if not isinstance(streams["ranks"], list) or len(streams["ranks"]) != world:
            f.bad("stream.ranks", f"one entry per rank ({world}) expected")
        out["stream"] = streams
        out["facts"] = f.items(f.json("facts"), "facts", world,
                               lambda v, field: facts(f, v, field, per_rank, b, limits.sources))
        for r, v in enumerate(out["facts"]):
            logged = _add(by_rank, f"rank{r}", v, logged)
        carried = f.json("carried")
        if carried is not None:
            for k, v in f.mapping(carried, "carried").items():
                logged = _add(by_rank, k, facts(f, v, f"carried.{k}", samples, None, limits.sources), logged)
        out["carried"] = carried
    if seen != sum(by_rank.values()):  # a step's samples are its batches': the run's counts must add up to it
        f.bad("position.seen", f"{seen}, but the run's epochs and tallies hold {sum(by_rank.values())} samples")
    counts = f.json("key_counts")  # a count per rank of this world, then those of ranks a larger one had
    if isinstance(counts, list) and world <= len(counts) <= state_format.MAX_WORLD:
        world_counts = len(counts)
    else:
        world_counts = world
    out["key_counts"] = f.items(counts, "key_counts", world_counts, lambda v, field: f.integer(v, field, 0, seen))
    for r in range(world, world_counts):  # a rank a smaller world left out must have been in the run
        if f"rank{r}" not in by_rank:
            f.bad(f"key_counts[{r}]", f"a count for rank {r}, but no rank {r} consumed a sample in this run")
    for r, n in enumerate(out["key_counts"]):  # a line per sample the rank consumed, at most
        if n > by_rank.get(f"rank{r}", 0):
            f.bad(f"key_counts[{r}]", f"{n} key lines, but the run's counts say rank {r} consumed "
                                      f"{by_rank.get(f'rank{r}', 0)} samples")
        if logged is not None and n != logged.get(f"rank{r}", 0):  # an edited count cut keys-rank*.txt silently
            f.bad(f"key_counts[{r}]", f"{n} key lines, but the run's tallies say rank {r} logged "
                                      f"{logged.get(f'rank{r}', 0)}")
    if logged is not None:  # ranks a smaller world left out, in a checkpoint written before it kept their counts
        ranks = [int(k[4:]) for k in logged if k[4:].isdigit() and int(k[4:]) < state_format.MAX_WORLD]
        out["key_counts"] += [logged.get(f"rank{r}", 0) for r in range(len(out["key_counts"]), max(ranks, default=-1) + 1)]
    if not mid:
        return out
    sums = f.json("log_sums")
    if sums is not None:  # per source a loss sum and a sample count, then the skipped samples
        n = limits.sources
        f.items(sums, "log_sums", 2 * n + 1, lambda x, fd: x)
        counts = [f.number(x, f"log_sums[{n + i}]", 0, seen, whole=True) for i, x in enumerate(sums[n:2 * n])]
        for i, (loss, count) in enumerate(zip(sums[:n], counts)):
            f.number(loss, f"log_sums[{i}]", 0, math.inf if count else 0)  # no samples, no loss
        f.number(sums[2 * n], f"log_sums[{2 * n}]", 0, order.MAX_COUNT, whole=True)
    out["log_sums"] = sums
    return out


def facts(f, v, field, most, b, sources):
    """A rank's tally of an epoch (`_Fields` f): its batches (at most `most`), samples per source
    (`b` samples a batch where the batch size is known: the run's own part of the epoch),
    skipped samples and times."""
    f.mapping(v, field, ("batches", "samples", "skipped", "wait", "busy"))
    n = f.integer(v["batches"], f"{field}.batches", 0, most)
    per = f.items(v["samples"], f"{field}.samples", sources, lambda x, fd: f.integer(x, fd, 0, order.MAX_COUNT))
    if b is not None and sum(per) != n * b:
        f.bad(f"{field}.samples", f"{sum(per)} samples in {n} batches of {b}")
    f.integer(v["skipped"], f"{field}.skipped", 0, order.MAX_COUNT)
    f.number(v["wait"], f"{field}.wait")
    f.number(v["busy"], f"{field}.busy")
    if "keys" in v:
        f.integer(v["keys"], f"{field}.keys", 0, sum(per))  # a key line per sample, at most
    return v


def _add(by_rank, key, tally, logged=None):
    """A tally's samples added to its rank's ("rank3" or "before_resume_rank3"), and its key lines
    to `logged`'s; returns `logged`, None where the tally did not count key lines."""
    rank = "rank" + key.rsplit("rank", 1)[-1]
    by_rank[rank] = by_rank.get(rank, 0) + sum(tally["samples"])
    if logged is None or "keys" not in tally:
        return None
    logged[rank] = logged.get(rank, 0) + tally["keys"]
    return logged


def set_rng(state, path):
    """torch's CPU generator from the checkpoint's `rng`, checked to be one."""
    rng, like = state.get("rng"), torch.get_rng_state()
    if not (isinstance(rng, torch.Tensor) and rng.dtype == like.dtype and rng.shape == like.shape):
        _Fields(path, state).bad("rng", f"{short(rng, show=json.dumps)}; a uint8 tensor of {len(like)} bytes expected")
    try:
        torch.set_rng_state(rng.cpu())
    except RuntimeError as e:
        _Fields(path, state).bad("rng", _first_line(e))


def load_model(model, state, path):
    """The checkpoint's weights into `model`: tensors only, finite, of this model's shapes."""
    f = _Fields(path, state)
    weights = f.mapping(state.get("model"), "model")
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            f.bad(f"model.{name}", f"{short(t, show=json.dumps)}; a tensor expected")
        if t.is_complex() or t.is_floating_point() and not bool(torch.isfinite(t).all()):
            f.bad(f"model.{name}", "values that are not finite (or complex)")
        if name.endswith("running_var") and bool((t < 0).any()):  # BatchNorm would take its square root
            f.bad(f"model.{name}", "negative variances")
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        f.bad("model", f"it does not fit this run's model ({_first_line(e)}); the sources' classes, --model "
                       f"and --width must be those the checkpoint was trained with")


def load_optimizer(opt, state, path):
    """The checkpoint's optimiser state into `opt`: momentum buffers of the parameters' shapes
    and finite. The hyper-parameters stay this run's (the command line's), not the file's."""
    f = _Fields(path, state)
    saved = f.mapping(state.get("optimizer"), "optimizer", ("state", "param_groups"))
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = saved["param_groups"]
    numbers = [k for g in groups for k in g.get("params", ())] if isinstance(groups, list) and \
        all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups) else None
    if numbers != list(range(len(params))):  # what torch writes; any other order would swap momentum buffers
        f.bad("optimizer.param_groups", f"parameters {short(numbers, show=json.dumps)}; 0..{len(params) - 1} in order expected")
    for k, entry in f.mapping(saved["state"], "optimizer.state").items():
        if type(k) is not int or not 0 <= k < len(params):
            f.bad("optimizer.state", f"key {short(k, show=json.dumps)}; parameter numbers 0..{len(params) - 1} expected")
        f.mapping(entry, f"optimizer.state.{k}")
    own = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    try:
        opt.load_state_dict(saved)
    except (RuntimeError, KeyError, TypeError, ValueError, IndexError) as e:
        f.bad("optimizer", f"it does not fit this run's model ({_first_line(e)})")
    for g, hyper in zip(opt.param_groups, own):
        g.update(hyper)
    for i, p in enumerate(params):
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is None:
            continue
        if not (isinstance(buf, torch.Tensor) and buf.shape == p.shape and buf.is_floating_point()):
            f.bad(f"optimizer.state.{i}.momentum_buffer", f"{short(buf, show=json.dumps)}; a tensor of shape {list(p.shape)} expected")
        if not bool(torch.isfinite(buf).all()):
            f.bad(f"optimizer.state.{i}.momentum_buffer", "values that are not finite")
        if buf.stride() != p.stride():  # saved in the other memory format (--channels-last added or dropped):
            # the fused step walks a parameter and its buffer as one flat range, so they must be laid out alike
            opt.state[p]["momentum_buffer"] = torch.empty_like(p).copy_(buf)


def _first_line(e):
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else (lines or [""])[0]
    return (text[:200] + "...") if len(text) > 200 else text or e.__class__.__name__


def save(path, state):
    """Write to a temporary name, load it back as any reader may (torch.load with weights_only=True:
    tensors and plain types only), then rename: a kill or a full disk mid-save leaves the previous
    checkpoint as it was, and no file is kept that such a load refuses. Raises OSError in one line
    on failure; InputError naming the field where the state holds an object weights_only refuses
    (a --model of the user's whose state_dict holds one)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut leaves no empty checkpoint.pt
        torch.load(tmp, map_location="cpu", weights_only=True)  # readable back, without a second copy on a GPU
        os.replace(tmp, path)
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        kept = "the previous checkpoint is kept" if os.path.exists(path) else "there is no earlier checkpoint"
        where = refused_at(state) if isinstance(e, pickle.UnpicklingError) else None
        if where:
            raise InputError(f"could not write the checkpoint {path}: {where} holds an object that torch.load(..., "
                             f"weights_only=True) refuses ({_refusal(e)}); a checkpoint keeps tensors and plain types "
                             f"only (a --model of your own: keep other objects out of its state_dict); {kept}") from None
        cause = e.__context__ if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError) else e
        reason = " ".join(str(cause).split()) or cause.__class__.__name__  # torch's "unexpected pos" hides the file's
        raise OSError(f"could not write the checkpoint {path} ({reason}); {kept}") from None


def refused_at(value, where=""):
    """The dotted place in `value` (a checkpoint's state, a model's extra state) of the first object
    that torch.load's weights_only refuses, or None: what save() and the model's check name."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
        return None
    except pickle.UnpicklingError:
        pass
    for k, v in value.items() if isinstance(value, dict) else ():
        inner = refused_at(v, f"{where}.{k}" if where else str(k))
        if inner:
            return inner
    return where or None


def _refusal(e):
    """torch's reason in its weights_only message (`Unsupported global: GLOBAL list was not an allowed global
    by default`), without the paragraphs around it."""
    lines = [ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler error:" in ln]
    return lines[0].split("WeightsUnpickler error:", 1)[1].split(". ")[0].strip() if lines else short(str(e))


def load(path, device="cpu"):
    """The checkpoint at `path`, loaded with weights_only=True (no code runs); ValueError if
    it is not one this version wrote."""
    try:
        f = open_regular(path)  # a FIFO would block torch.load forever
    except (OSError, ShardError) as e:
        raise ValueError(f"{path}: not a checkpoint ({e})") from None
    try:
        with f:
            state = torch.load(f, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{path}: not a loadable checkpoint ({e.__class__.__name__}: {first})") from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise ValueError(f"{path}: checkpoint version {version}, this trainer reads version {VERSION}")
    return state
