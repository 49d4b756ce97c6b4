"""The README's streaming-API example as a file: python examples/stream_api.py [NAME=SPEC ... | SHARDS_DIR]

Reads the training sources given as the trainer's --train takes them (mnist=/data/mnist/
cifar10=/other/place/cifar10-train.json), or mnist's and cifar10's from one SHARDS_DIR (default
shards/, as `make demo` or `tools/make_shards.py --synthetic` writes them), mixed with equal
weights, for two epochs, and prints the first batch's shapes and the saved stream state. Under
torchrun each rank reads its own share.
"""
import argparse
import sys

p = argparse.ArgumentParser(prog="stream_api", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("sources", nargs="*", default=["shards/"], metavar="NAME=SPEC|SHARDS_DIR",
               help="a training source as the trainer's --train takes it (a folder, manifest, URL or pattern, "
                    "holding NAME-train.json), or a folder holding mnist-train.json and cifar10-train.json "
                    "(default: shards/)")
given = {}
for item in p.parse_args().sources:                # --help answers before torch loads
    name, sep, spec = item.partition("=")
    if not sep:                                    # a bare folder: both data sets in it
        given.update(mnist=item, cifar10=item)
    elif name and spec and name not in given:
        given[name] = spec
    else:
        sys.exit(f"stream_api: error: {item!r}: expected NAME=SPEC, once per name (mnist=shards/), or a folder")

from pipeline.errors import ShardError  # noqa: E402
from pipeline.stream import MixedStream, make_loader, resolve  # noqa: E402
from pipeline.topology import Topology  # noqa: E402

try:
    sources = [resolve(name, spec, "train") for name, spec in given.items()]
except ShardError as e:                            # no such folder, no manifest: one line, not a traceback
    sys.exit(f"stream_api: error: {e}")
stream = MixedStream(sources, {name: 1 / len(given) for name in given}, batch_size=64, topo=Topology.from_env(),
                     seed=0, epoch_samples=min(20000, sum(s.total for s in sources)))
print(f"{stream.layout.num_classes} classes over {', '.join(stream.layout.names)}")  # the head's size
loader = make_loader(stream, num_workers=2)        # make it once: its workers persist across epochs
for epoch in range(2):
    stream.set_epoch(epoch)                        # new order each epoch, identical on every rank
    for i, batch in enumerate(loader):             # len(stream) batches on every rank
        x, y, src = batch["image"], batch["label"], batch["source"]   # src: each sample's source index
        if i == 0:
            print(f"epoch {epoch}: {len(stream)} batches; image {tuple(x.shape)} {x.dtype}, label {tuple(y.shape)}")
    state = stream.state_dict()                    # JSON: where this rank stands, to the batch
print("state keys:", sorted(state))
# to go on: stream.load_state_dict(state) on the same world, else a list of every rank's state
# (torch.distributed.all_gather_object); before or after set_epoch and make_loader, the next pass
# starts where the state stopped, and a state saved at an epoch's end starts the next epoch
