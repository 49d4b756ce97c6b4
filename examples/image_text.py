"""Stream an img2dataset-shaped WebDataset (jpg + txt + json a sample) into a small image-text
model in your own loop: python examples/image_text.py SHARDS_DIR [--name laion] [--steps 20]

Index the shards once, in place, with the fields to read (docs/data.md, "Fields"):

    python tools/make_shards.py --index laion:train=SHARDS_DIR --out SHARDS_DIR \\
        --fields 'image:image=jpg;png;webp,fit=center-crop,size=64x64 caption:text=txt,max=4000'

Each batch holds `image` (uint8 B x 3 x 64 x 64), `caption` (token ids: a tokenising stage runs
in the loader's workers, here the caption's UTF-8 bytes) with `caption_len`, `key` and
`source`. The model is a CLIP-like pair of encoders trained with a contrastive loss for a few
steps; under torchrun each rank reads its own share.
"""
import argparse
import sys

p = argparse.ArgumentParser(prog="image_text", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("shards", metavar="SHARDS_DIR", help="a folder holding NAME-train.json (indexed with --fields)")
p.add_argument("--name", default="laion", help="the data set's name in its manifest (default: laion)")
p.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
p.add_argument("--workers", type=int, default=2, help="loader workers (default: 2)")
args = p.parse_args()                              # --help answers before torch loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.data.fields import augment  # noqa: E402
from pipeline.data.fields.schema import Schema  # noqa: E402
from pipeline.errors import ShardError  # noqa: E402
from pipeline.stream import MixedStream, make_loader, resolve  # noqa: E402
from pipeline.topology import Topology  # noqa: E402


def utf8_ids(text):
    """A stand-in tokeniser: the caption's bytes (use your own: it runs in the loader's workers)."""
    return list(text.encode("utf-8"))


try:
    source = resolve(args.name, args.shards, "train")
except ShardError as e:                            # no such folder, no manifest: one line, not a traceback
    sys.exit(f"image_text: error: {e}")
if source.schema is None or {"image", "caption"} - {c.name for c in source.schema.columns}:
    sys.exit(f"image_text: error: {source.manifest} has no image and caption fields; index it with --fields (see --help)")
schema = Schema(source.schema.columns, stages=[augment.Flip("image"), augment.Tokenize("caption", utf8_ids, 32)])
stream = MixedStream([source], {args.name: 1}, batch_size=16, topo=Topology.from_env(), seed=0,
                     schemas={args.name: schema}, normalize=False)  # uint8 images: normalised in the loop
loader = make_loader(stream, num_workers=args.workers)

images = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 5, stride=4), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                             torch.nn.Flatten(), torch.nn.Linear(16, 32))
texts = torch.nn.EmbeddingBag(256, 32, mode="mean", padding_idx=0)
opt = torch.optim.Adam([*images.parameters(), *texts.parameters()], lr=1e-3)
step = 0
while step < args.steps:
    for batch in loader:
        x = batch["image"].float() / 255                # uint8 in the batch: normalise in your loop
        a = F.normalize(images(x), dim=1)
        b = F.normalize(texts(batch["caption"]), dim=1)  # token ids padded with 0 (padding_idx)
        loss = F.cross_entropy(a @ b.T * 10, torch.arange(len(a)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            print(f"image {tuple(batch['image'].shape)} {batch['image'].dtype}, caption ids "
                  f"{tuple(batch['caption'].shape)}, lengths {batch['caption_len'][:4].tolist()}")
        step += 1
        if step == args.steps:
            break
print(f"{step} steps, contrastive loss {loss.item():.3f}")
