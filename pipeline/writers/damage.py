"""The damaged-image rule of indexing, one for `--index` and `--index --fields` (and both on
first use): an image that cannot be decoded (cut short, corrupt, over MAX_PIXELS), as real
img2dataset sets hold a few of, makes its sample damaged, not the set refused. The sample
stays a position of the set, as damage found after indexing does (the stream skips it and
counts it in `skipped`); one warning line names the first few; a set none of whose samples
decodes, or more than a share of them (MAX_DAMAGED, or make-shards --max-damaged), is refused
in one line: that many is a wrong member or a bad copy, not a few broken downloads."""
import argparse
from fractions import Fraction

from pipeline.data.decoding.decode import pil_reason
from pipeline.data.decoding.labelling import CONTENT_ERRORS
from pipeline.errors import ShardError, redact

MAX_DAMAGED = 0.05  # the share of samples that may fail to decode before an index refuses the set
DAMAGE_SHOWN = 3  # damaged samples named in the warning or refusal


def decoded(scan, key, ext, decode):
    """decode()'s result; None for an image it cannot decode (a ValueError, a decoder's error):
    the sample `key` is then counted in the scan as a damaged position, its reason kept for the
    warning, and the caller leaves it out of the shapes, labels and pixel sums."""
    from PIL import Image

    try:
        return decode()
    except ValueError as e:
        reason = str(e)
    except (Image.DecompressionBombError, *CONTENT_ERRORS) as e:
        reason = f"undecodable .{ext} image ({pil_reason(e)})"
    scan["samples"] += 1
    scan["damaged"] += 1
    if len(scan["damage"]) < DAMAGE_SHOWN:
        scan["damage"].append((key, reason))
    return None


def damage_check(found, spec, name, share=None):
    """One warning line for a set with damaged samples (how many, the first few and why), None
    for one without; ShardError (one line) when none of its samples can be decoded, or more than
    `share` (default MAX_DAMAGED) of them cannot."""
    share = MAX_DAMAGED if share is None else share
    damaged, total = sum(f["damaged"] for f in found), sum(f["samples"] for f in found)
    if not damaged:
        return None
    first = [(f["url"], k, why) for f in found for k, why in f["damage"]][:DAMAGE_SHOWN]
    named = "; ".join(f"{redact(u)}: sample {k}: {why}" for u, k, why in first)
    if damaged == total:
        raise ShardError(f"{redact(spec)}: none of its {total} samples can be decoded, e.g. {named}")
    if Fraction(damaged, total) > Fraction(str(share)):  # as written: 0.29 * 100 is 28.999999999999996 in floats
        raise ShardError(f"{redact(spec)}: {damaged} of {total} samples cannot be decoded, more than {percent(share)} "
                         f"(make-shards --max-damaged, default {percent(MAX_DAMAGED)}: "
                         f"pipeline.writers.damage.MAX_DAMAGED), e.g. {named}")
    return (f"{name}: warning: {damaged} of {total} samples cannot be decoded (e.g. {named}); they will be skipped and "
            f"counted while training")


def percent(share):
    return f"{round(share * 100, 4):g}%"


def share_arg(text):
    """--max-damaged's value: a fraction in [0, 1] (argparse makes the error one line)."""
    try:
        share = float(text)
    except ValueError:
        share = None
    if share is None or not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction of the samples in [0, 1] expected (e.g. 0.1 for 10%)")
    return share


def add_options(a):
    """make_shards' --max-damaged."""
    a("--max-damaged", type=share_arg, metavar="SHARE",
      help=f"with --index: the share of samples whose image cannot be decoded that the index takes as damaged "
           f"(skipped and counted while training) before it refuses the set (default {MAX_DAMAGED}; a set none of "
           f"whose samples decodes is always refused; indexing on first use keeps the default)")
