"""A WebDataset opened by its URL, in a plain loop, resumable mid-epoch:
python examples/dataloader_loop.py SPEC [--epochs 2] [--stop-after N] [--state FILE] [--keys FILE]

SPEC is a folder, glob, brace pattern (http(s) too) or store prefix of shards with no manifest:
the first run indexes them (pipeline.writers.autoindex) and infers their fields from the members
(image, caption, class, the .json's numbers). The loop reads the fields' batches through the
DataLoader face (pipeline.data.handover.dataloader.StatefulLoader): --stop-after N stops after N batches
and writes the loader's state to --state; the next run with the same --state goes on where it
stopped. --keys appends each batch's sample keys to FILE, one "epoch<TAB>key" a line.
"""
import argparse
import json
import os

p = argparse.ArgumentParser(prog="dataloader_loop", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("spec", metavar="SPEC", help="the shards: a folder, glob, brace pattern or store prefix")
p.add_argument("--epochs", type=int, default=2, help="epochs in all (default: 2)")
p.add_argument("--batch-size", type=int, default=8, help="samples a batch (default: 8)")
p.add_argument("--workers", type=int, default=2, help="loader workers (default: 2)")
p.add_argument("--stop-after", type=int, metavar="N", help="stop after N batches, writing --state")
p.add_argument("--state", metavar="FILE", default="loader-state.json", help="the loader's state (default: %(default)s)")
p.add_argument("--keys", metavar="FILE", help="append 'epoch<TAB>key' of every sample read to FILE")
args = p.parse_args()                              # --help answers before torch loads

from pipeline.data.handover.dataloader import StatefulLoader  # noqa: E402
from pipeline.stream import MixedStream, resolve  # noqa: E402
from pipeline.topology import Topology  # noqa: E402

source = resolve("web", args.spec, "train")        # indexed on first use, reused after
stream = MixedStream([source], {"web": 1}, batch_size=args.batch_size, topo=Topology.from_env(), seed=0)
loader = StatefulLoader(stream, num_workers=args.workers)
if os.path.exists(args.state):
    with open(args.state) as f:
        loader.load_state_dict(json.load(f))       # mid-epoch: the rest of that epoch comes next
read = 0
while loader.pending < args.epochs:
    for batch in loader:
        if read == 0:
            print("batch:", {k: tuple(v.shape) if hasattr(v, "shape") else type(v).__name__ for k, v in batch.items()})
        if args.keys:
            with open(args.keys, "a") as f:
                f.writelines(f"{loader.epoch}\t{k}\n" for k in batch["key"])
        read += 1
        if read == args.stop_after:
            with open(args.state, "w") as f:
                json.dump(loader.state_dict(), f)  # JSON: where this rank stands, to the batch
            print(f"stopped after {read} batches; state in {args.state}")
            loader.close()
            raise SystemExit(0)
loader.close()
print(f"done: {read} batches")
