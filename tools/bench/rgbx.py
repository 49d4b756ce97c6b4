"""Colour JPEGs into NCHW batches, RGB against RGBX (pipeline.data.decoding.rgbx), in one process,
alternating every round: each job's median microseconds a JPEG and the per-round ratio of RGBX's
time over RGB's (median and quartiles). Process CPU time, one torch thread.

    python tools/bench/rgbx.py [--work-dir DIR --set small] [--rounds 30]

Jobs, over batches of 128:
  decode        simplejpeg.decode_jpeg of each JPEG (colorspace RGB or RGBX), nothing else
  slice copy    the decoded batch joined and copied into rows 0..127 of a batch (one source's rows)
  gather copy   the same into every other row of a 256-row batch (two sources mixed)
  two chunks    each decoded batch as two views joined (rgbx.concatenate: a damaged sample or a window's
                end splits one source's share of a batch), then the slice copy
  whole         decode, join and slice copy: what the stream's Decode stage and collate do
With --work-dir, the JPEGs of the set `tools/bench_loader.py --jpeg` built there; else 4,096
synthetic 32x32 photos-like JPEGs (smooth gradients and noise, quality 90) made here.
"""
import argparse
import io
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pipeline.data.decoding import rgbx  # noqa: E402

BATCH = 128


def synthetic(n, side=32, seed=0):
    from PIL import Image

    rng, out = np.random.default_rng(seed), []
    yy, xx = np.mgrid[0:side, 0:side]
    for _ in range(n):
        a, b, c = rng.random(3)
        base = np.stack([yy * a, xx * b, (yy + xx) * c], -1) * (255 / (2 * side))
        img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def jobs(datas):
    import simplejpeg

    dec = simplejpeg.decode_jpeg
    h, w = dec(datas[0]).shape[:2]
    datas = [d for d in datas if dec(d).shape[:2] == (h, w)]
    batches = [datas[i:i + BATCH] for i in range(0, len(datas) // BATCH * BATCH, BATCH)]
    n = len(batches) * BATCH
    decoded = {"RGB": [[dec(d, colorspace="RGB") for d in b] for b in batches],
               "RGBX": [[dec(d, colorspace="RGBX") for d in b] for b in batches]}
    one, two = np.zeros((BATCH, 3, h, w), np.uint8), np.zeros((2 * BATCH, 3, h, w), np.uint8)
    every_other = np.arange(0, 2 * BATCH, 2)

    def view(space, pixels):
        if space == "RGBX":
            return rgbx.joined(pixels, len(pixels), h, w)
        return np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), h, w, 3).transpose(0, 3, 1, 2)

    def decode(space):
        for b in batches:
            [dec(d, colorspace=space, strict=True) for d in b]

    def copy(space, into, rows):
        for pixels in decoded[space]:
            rgbx.assign(into, rows, view(space, pixels))

    def two_chunks(space):
        for pixels in decoded[space]:
            half = len(pixels) // 2
            rgbx.assign(one, slice(0, BATCH), rgbx.concatenate([view(space, pixels[:half]), view(space, pixels[half:])]))

    def whole(space):
        for b in batches:
            rgbx.assign(one, slice(0, BATCH), view(space, [dec(d, colorspace=space, strict=True) for d in b]))

    table = {"decode": decode, "slice copy": lambda s: copy(s, one, slice(0, BATCH)),
             "gather copy": lambda s: copy(s, two, every_other), "two chunks": two_chunks, "whole": whole}
    return n, table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir")
    p.add_argument("--set", default="small")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    if args.work_dir:
        from bench import jpeg

        name = f"jpeg{args.set}"
        datas = jpeg.jpegs_of(os.path.join(args.work_dir, f"jpeg-{args.set}"), name)[:4096]
    else:
        datas = synthetic(4096)
    n, table = jobs(datas)
    times = {(job, space): [] for job in table for space in ("RGB", "RGBX")}
    for r in range(args.rounds):
        for job, fn in table.items():
            for space in (("RGB", "RGBX") if r % 2 else ("RGBX", "RGB")):
                t0 = time.process_time()
                fn(space)
                times[job, space].append((time.process_time() - t0) / n * 1e6)
    print(f"{n} JPEGs, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}: us a JPEG (median); RGBX over RGB, "
          f"per round (median [quartiles])")
    for job in table:
        rgb, four = times[job, "RGB"], times[job, "RGBX"]
        ratios = sorted(f / g for f, g in zip(four, rgb))
        q = statistics.quantiles(ratios, n=4)
        print(f"  {job:12} RGB {statistics.median(rgb):6.3f}  RGBX {statistics.median(four):6.3f}  "
              f"ratio {q[1]:.3f} [{q[0]:.3f}-{q[2]:.3f}]")


if __name__ == "__main__":
    main()
