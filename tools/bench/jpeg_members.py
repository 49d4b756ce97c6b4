"""A JPEG shard's members handed on as copies or as views of the shard's bytes, timed in one
process, alternating every round: what the read (reading.Reader._images) and the remembered
header's check (decode._turbo_batch, jpeg.known_again) cost a member each way.

    python tools/bench/jpeg_members.py bench-out/jpeg-small --rounds 31

- "bytes(slice)": each member `bytes(buf[a:a + z])`, the check `data.startswith(prefix)`;
- "slice": each member `buf[a:a + z]` (a slice of bytes is already its one copy), the same check;
- "view + offset": each member `memoryview(buf)[a:a + z]`, the check `buf.startswith(prefix, a)`
  at its offset in the shard (a memoryview has no startswith, and comparing one to the
  prefix, `view[:len(prefix)] == prefix`, goes byte by byte: microseconds a member).
Prints the median microseconds a member of each, and each one's per-round ratio to "slice".
"""
import argparse
import glob
import os
import statistics
import time

from pipeline.data.decoding import jpeg
from pipeline.data.shards.regular import regular_members


def _copies(wrap):
    def run(shards, prefix, short):
        hits = 0
        for buf, starts, sizes in shards:
            members = [wrap(buf[a:a + z]) for a, z in zip(starts, sizes)]
            for data in members:
                hits += len(data) < short and type(data) is bytes and data.startswith(prefix)
        return hits
    return run


def _views(shards, prefix, short):
    hits = 0
    for buf, starts, sizes in shards:
        whole = memoryview(buf)
        members = [whole[a:a + z] for a, z in zip(starts, sizes)]
        for data, a in zip(members, starts):
            hits += len(data) < short and buf.startswith(prefix, a)
    return hits


JOBS = {"bytes(slice)": _copies(bytes), "slice": _copies(lambda b: b), "view + offset": _views}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shards", help="a folder of JPEG shards (tools/bench_loader.py --jpeg's jpeg-small)")
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--count", type=int, default=5, help="how many of its shards")
    args = p.parse_args(argv)
    shards = []
    for path in sorted(glob.glob(os.path.join(args.shards, "*.tar")))[:args.count]:
        buf = open(path, "rb").read()
        found = regular_members(buf, "jpg", "cls")
        if found is None:
            raise SystemExit(f"jpeg_members: {path} is not a shard of jpg + cls samples")
        shards.append((buf, found[2].tolist(), found[3].tolist()))
    if not shards:
        p.error(f"no .tar files in {args.shards}")
    buf, starts, sizes = shards[0]
    prefix, short = jpeg.known_again(jpeg.header(buf[starts[0]:starts[0] + sizes[0]]))
    n = sum(len(s[1]) for s in shards)
    hits = {name: job(shards, prefix, short) for name, job in JOBS.items()}
    if len(set(hits.values())) != 1:
        raise SystemExit(f"jpeg_members: the ways disagree on the remembered header: {hits}")
    got = {name: [] for name in JOBS}
    for r in range(args.rounds):
        for name, job in (list(JOBS.items()) if r % 2 == 0 else list(JOBS.items())[::-1]):
            t = time.process_time()
            job(shards, prefix, short)
            got[name].append((time.process_time() - t) / n * 1e6)
    print(f"{n} members of {len(shards)} shards, {args.rounds} rounds, {hits['slice']} with the first's header; "
          f"us a member (median), and its ratio to slice (median of the rounds):")
    for name, times in got.items():
        ratio = statistics.median(t / s for t, s in zip(times, got["slice"]))
        print(f"  {name:14} {statistics.median(times):.3f} us   {ratio:.3f}")


if __name__ == "__main__":
    main()
