"""Checkpoints: written whole or not at all, loaded without unpickling code, and refused
when they belong to a different run.

A checkpoint holds the model, optimiser and RNG states, where the run stands (epoch,
step, samples seen, every rank's stream state, the partial sums of the current
metrics line) and a fingerprint of what must not change across a resume: the
sources in order with their classes and shapes, model width, batch size, seed,
epoch samples and weights. `check_resume` lists every difference in one line.
"""
import json
import os

import torch

VERSION = 2


def fingerprint(args, sources):
    """What a resumed run must share with the run that wrote the checkpoint."""
    return {
        "sources": [{"name": s.name, "classes": len(s.classes), "shape": list(s.shape)} for s in sources],
        "width": args.width, "batch_size": args.batch_size, "seed": args.seed,
        "epoch_samples": args.epoch_samples, "weights": [round(w, 12) for w in args.weights],
        "final_weights": [round(w, 12) for w in args.final_weights] if args.final_weights else None,
    }


def check_resume(saved, current, allow_weights=False):
    """Raise ValueError listing every field that differs (weights only if not allowed)."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        if allow_weights and key in ("weights", "final_weights"):
            continue
        if saved.get(key) != current.get(key):
            diffs.append(f"{key}: checkpoint {_show(saved.get(key))}, now {_show(current.get(key))}")
    if diffs:
        hint = "" if allow_weights or not any(d.startswith(("weights", "final_weights")) for d in diffs) else \
            " (pass --change-weights to change the mixture on purpose)"
        raise ValueError("--resume with other settings than the checkpoint's: " + "; ".join(diffs) + hint)


def _show(value):
    if isinstance(value, list) and value and isinstance(value[0], dict) and "name" in value[0]:
        return "[" + ", ".join(f"{v['name']} {v['classes']} classes {'x'.join(map(str, v['shape']))}"
                               for v in value) + "]"
    return json.dumps(value)


def save(path, state):
    """Write to a temporary name, load it back, then rename: a kill or a full disk mid-save
    leaves the previous checkpoint as it was. Raises OSError in one line on failure."""
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        torch.load(tmp, map_location="cpu", weights_only=True)  # readable back, without a second copy on a GPU
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        reason = " ".join(str(e).split()) or e.__class__.__name__
        raise OSError(f"could not write the checkpoint {path} ({reason}); the previous checkpoint is kept") from None


def load(path, device="cpu"):
    """The checkpoint at `path`, loaded with weights_only=True (no code runs); ValueError if
    it is not one this version wrote."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{path}: not a loadable checkpoint ({e.__class__.__name__}: {first})") from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise ValueError(f"{path}: checkpoint version {version}, this trainer reads version {VERSION}")
    return state
