"""The README's streaming-API example as a file: python examples/stream_api.py [SHARDS_DIR]

Reads mnist and cifar10 manifests from SHARDS_DIR (default shards/, as `make demo` or
`tools/make_shards.py --synthetic` writes them) for two epochs and prints the first batch's shapes
and the saved stream state. Under torchrun each rank reads its own share.
"""
import argparse
import sys

p = argparse.ArgumentParser(prog="stream_api", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("shards", nargs="?", default="shards/", metavar="SHARDS_DIR",
               help="a folder holding mnist-train.json and cifar10-train.json and their shards (default: shards/)")
shards = p.parse_args().shards                     # --help answers before torch loads

from pipeline.errors import ShardError  # noqa: E402
from pipeline.stream import MixedStream, make_loader, resolve  # noqa: E402
from pipeline.topology import Topology  # noqa: E402

try:
    sources = [resolve("mnist", shards, "train"), resolve("cifar10", shards, "train")]
except ShardError as e:                            # no such folder, no manifest: one line, not a traceback
    sys.exit(f"stream_api: error: {e}")
stream = MixedStream(sources, {"mnist": 0.5, "cifar10": 0.5}, batch_size=64, topo=Topology.from_env(), seed=0)
loader = make_loader(stream, num_workers=2)        # make it once: its workers persist across epochs
for epoch in range(2):
    stream.set_epoch(epoch)                        # new order each epoch, identical on every rank
    for i, batch in enumerate(loader):             # len(stream) batches on every rank
        x, y, src = batch["image"], batch["label"], batch["source"]
        if i == 0:
            print(f"epoch {epoch}: {len(stream)} batches; image {tuple(x.shape)} {x.dtype}, label {tuple(y.shape)}")
    state = stream.state_dict()                    # JSON: where this rank stands, to the batch
print("state keys:", sorted(state))
# later, before the first pass: stream.load_state_dict(state) (one rank's) or {"ranks": [every rank's]}
