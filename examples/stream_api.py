"""The README's streaming-API example as a file: python examples/stream_api.py [SHARDS_DIR]

Reads mnist and cifar10 manifests from SHARDS_DIR (default shards/, as `make demo` or
`tools/make_shards.py --synthetic` writes them) for two epochs and prints the first batch's shapes
and the saved stream state. Under torchrun each rank reads its own share.
"""
import sys

from pipeline.stream import MixedStream, make_loader, resolve
from pipeline.topology import Topology

shards = sys.argv[1] if len(sys.argv) > 1 else "shards/"
sources = [resolve("mnist", shards, "train"), resolve("cifar10", shards, "train")]
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
