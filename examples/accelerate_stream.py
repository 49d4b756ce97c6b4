"""A WebDataset opened by its URL, trained with Hugging Face `accelerate`, resumable mid-epoch:
python examples/accelerate_stream.py SPEC --out DIR [--epochs 2] [--stop-after N] [--keys FILE]

`accelerator.prepare` passes the loader (pipeline.data.handover.dataloader.StatefulLoader) through as it
is: it is no torch DataLoader, and the stream already gives each rank its share under
`accelerate launch` (torchrun's variables). `accelerator.register_for_checkpointing(loader)`
puts its state_dict() into `save_state`: --stop-after N saves the state after N steps into DIR
and stops; a run with the same --out loads it and goes on at the next batch. The set is read as
image and class (autoindex.trainable); accelerate is not a dependency: pip install accelerate.
"""
import argparse
import os

p = argparse.ArgumentParser(prog="accelerate_stream", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("spec", metavar="SPEC", help="the shards: a folder, glob, brace pattern or store prefix")
p.add_argument("--out", required=True, metavar="DIR", help="accelerate's saved state goes here")
p.add_argument("--epochs", type=int, default=2, help="epochs in all (default: 2)")
p.add_argument("--batch-size", type=int, default=8, help="samples a batch (default: 8)")
p.add_argument("--workers", type=int, default=2, help="loader workers (default: 2)")
p.add_argument("--stop-after", type=int, metavar="N", help="stop after N steps, saving the state into --out")
p.add_argument("--keys", metavar="FILE", help="append 'epoch<TAB>key' of every sample trained to FILE")
args = p.parse_args()                              # --help answers before torch loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from pipeline.writers import autoindex  # noqa: E402
from pipeline.data.handover.dataloader import StatefulLoader  # noqa: E402
from pipeline.stream import MixedStream, resolve  # noqa: E402
from pipeline.topology import Topology  # noqa: E402

accelerator = Accelerator(cpu=True)
source = autoindex.trainable(resolve("web", args.spec, "train"))   # indexed on first use; image and class
stream = MixedStream([source], {"web": 1}, batch_size=args.batch_size, topo=Topology.from_env(), seed=0)
loader = StatefulLoader(stream, num_workers=args.workers)
model = torch.nn.Sequential(torch.nn.Conv2d(source.shape[0], 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, len(source.classes)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # the loader comes back as it is
accelerator.register_for_checkpointing(loader)
if os.path.isdir(args.out) and os.listdir(args.out):
    accelerator.load_state(args.out)               # the model, the optimiser and where the loader stood
step = 0
while loader.pending < args.epochs:
    for batch in loader:
        loss = F.cross_entropy(model(batch["image"].to(accelerator.device)), batch["label"].to(accelerator.device))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.keys:
            with open(args.keys, "a") as f:
                f.writelines(f"{loader.epoch}\t{k}\n" for k in batch["key"])
        step += 1
        if step == args.stop_after:
            accelerator.save_state(args.out)       # mid-epoch: the loader's state_dict() is in it
            loader.close()
            print(f"stopped after {step} steps; state in {args.out}")
            raise SystemExit(0)
loader.close()
print(f"done after {step} steps")
