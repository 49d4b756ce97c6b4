"""Mixture weights as the command line gives them: parsed and checked without torch or numpy,
so that `--help` and a bad `--weights` answer at once (pipeline.train.options)."""
import math


def parse_weights(text):
    """'mnist=0.5,cifar10=0.5' -> {'mnist': 0.5, 'cifar10': 0.5}; raises ValueError."""
    weights = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if name.strip() in weights:
            raise ValueError(f"weights {text!r}: {name.strip()} given twice")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"weights {text!r}: expected NAME=W,NAME=W, e.g. mnist=0.5,cifar10=0.5")
    return weights


def check_weights(weights, names):
    """Weights normalised to sum 1, in the order of `names`; raises ValueError on bad ones."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights name unknown source(s) {', '.join(unknown)}; sources are {', '.join(names)}")
    w = [float(weights.get(n, 0.0)) for n in names]
    if any(not 0 <= x < math.inf for x in w) or max(w) <= 0:  # also NaN and inf (inf/inf is NaN)
        raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
    w = [x / max(w) for x in w]  # first to at most 1: 1e308 + 1e308 would overflow the sum
    return [x / sum(w) for x in w]
