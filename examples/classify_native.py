"""A classification set read at its images' own resolution, with a random resized crop in the
loader's workers: python examples/classify_native.py SHARDS_DIR [--name pets] [--steps 20]

Index the shards once, in place, with the image at its native size (up to a cap) and the label:

    python tools/make_shards.py --index pets:train=SHARDS_DIR --out SHARDS_DIR \\
        --fields 'image:image=jpg;png;webp,fit=native,size=512x512 label:class=cls'

The stream's own schema adds the stages: a random resized crop to 64x64 and a flip, drawn from
each sample's seed, so a resumed run repeats them. Batches hold `image` (uint8 B x 3 x 64 x 64)
and `label`; a small linear model is trained for a few steps.
"""
import argparse
import sys

p = argparse.ArgumentParser(prog="classify_native", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("shards", metavar="SHARDS_DIR", help="a folder holding NAME-train.json (indexed with --fields)")
p.add_argument("--name", default="pets", help="the data set's name in its manifest (default: pets)")
p.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
p.add_argument("--classes", type=int, default=10, help="outputs of the model (default: 10)")
args = p.parse_args()                              # --help answers before torch loads

import torch  # noqa: E402

from pipeline.data.fields import augment  # noqa: E402
from pipeline.data.fields.schema import Schema  # noqa: E402
from pipeline.errors import ShardError  # noqa: E402
from pipeline.stream import MixedStream, make_loader, resolve  # noqa: E402

try:
    source = resolve(args.name, args.shards, "train")
except ShardError as e:
    sys.exit(f"classify_native: error: {e}")
if source.schema is None:
    sys.exit(f"classify_native: error: {source.manifest} has no fields; index it with --fields (see --help)")
schema = Schema(source.schema.columns, stages=[augment.RandomResizedCrop("image", 64), augment.Flip("image")])
stream = MixedStream([source], {args.name: 1}, batch_size=16, seed=0, schemas={args.name: schema},
                     normalize=False)  # uint8 images: scaled in the loop
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, args.classes))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = make_loader(stream, num_workers=2)        # make it once: its workers persist across passes
step = 0
while step < args.steps:
    for batch in loader:
        loss = torch.nn.functional.cross_entropy(model(batch["image"].float() / 255), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step == args.steps:
            break
print(f"image {tuple(batch['image'].shape)}, {step} steps, loss {loss.item():.3f}")
