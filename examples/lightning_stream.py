"""A WebDataset opened by its URL, trained with Lightning, resumable mid-epoch:
python examples/lightning_stream.py SPEC --out DIR [--epochs 2] [--stop-after N] [--keys FILE]

The stream is the train dataloader (pipeline.data.handover.dataloader.StatefulLoader): Lightning's fit
loop saves its state_dict() in every checkpoint and loads it on resume, so a run stopped inside
an epoch goes on at the next batch. --stop-after N stops after N steps with a checkpoint there
(DIR/last.ckpt); a run with the same --out resumes from it. Lightning fetches a batch ahead of
the step, so the loader is made with record=False and counts each batch as its step trains it. The
set is read as image and class (autoindex.trainable); Lightning is not a dependency of this
project: pip install lightning.
"""
import argparse
import os

p = argparse.ArgumentParser(prog="lightning_stream", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("spec", metavar="SPEC", help="the shards: a folder, glob, brace pattern or store prefix")
p.add_argument("--out", required=True, metavar="DIR", help="checkpoints go here (last.ckpt)")
p.add_argument("--epochs", type=int, default=2, help="epochs in all (default: 2)")
p.add_argument("--batch-size", type=int, default=8, help="samples a batch (default: 8)")
p.add_argument("--workers", type=int, default=2, help="loader workers (default: 2)")
p.add_argument("--stop-after", type=int, metavar="N", help="stop after N steps, writing DIR/last.ckpt")
p.add_argument("--keys", metavar="FILE", help="append 'epoch<TAB>key' of every sample trained to FILE")
args = p.parse_args()                              # --help answers before torch loads

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.writers import autoindex  # noqa: E402
from pipeline.data.handover.dataloader import StatefulLoader  # noqa: E402
from pipeline.stream import MixedStream, resolve  # noqa: E402
from pipeline.topology import Topology  # noqa: E402

source = autoindex.trainable(resolve("web", args.spec, "train"))   # indexed on first use; image and class
stream = MixedStream([source], {"web": 1}, batch_size=args.batch_size, topo=Topology.from_env(), seed=0)
loader = StatefulLoader(stream, num_workers=args.workers, record=False)


class Classifier(L.LightningModule):
    def __init__(self, classes, channels):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(channels, 8, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, classes))

    def training_step(self, batch, i):
        loader.used(batch)                         # this step trains it: a checkpoint after it counts it
        if args.keys:
            with open(args.keys, "a") as f:
                f.writelines(f"{loader.epoch}\t{k}\n" for k in batch["key"])
        return F.cross_entropy(self.net(batch["image"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


os.makedirs(args.out, exist_ok=True)
last = os.path.join(args.out, "last.ckpt")
every = [L.pytorch.callbacks.ModelCheckpoint(args.out, "last", every_n_train_steps=args.stop_after)] \
    if args.stop_after else []                     # a checkpoint inside the epoch, as a preempted job leaves
trainer = L.Trainer(max_epochs=args.epochs, max_steps=args.stop_after or -1, accelerator="cpu", devices=1,
                    callbacks=every, logger=False, enable_checkpointing=bool(every), enable_progress_bar=False)
trainer.fit(Classifier(len(source.classes), source.shape[0]), train_dataloaders=loader,
            ckpt_path=last if os.path.exists(last) else None)   # holds the loader's state_dict()
loader.close()
print(f"done at step {trainer.global_step}")
