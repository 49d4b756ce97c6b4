"""Write an ImageFolder tree as a WebDataset the way people publish them: `wds.ShardWriter`, each
image's bytes as they are, the class name in `.json` ({"label": "airplane"}), keys with the
class folder in them (`airplane/0001`). It stands in for somebody else's shards in docs/data.md's
recipes; the project's own shards come from tools/make_shards.py.

    python tools/write_wds.py CIFAR10_JPEGS/train CIFAR10_WDS --holdout 5000
    # CIFAR10_WDS/train/cifar10-000000.tar ..., CIFAR10_WDS/test/... (5,000 held out), seeded

`--label cls` writes the class index in `.cls` instead (the names then in OUT/classes.txt).
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.cli import Parser  # noqa: E402


def parse_args(argv):
    p = Parser(prog="write_wds", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="an ImageFolder tree: ROOT/<class>/<image>")
    p.add_argument("out", help="output folder: OUT/train/ and OUT/test/")
    p.add_argument("--holdout", type=int, default=5000, metavar="N", help="images held out as test/ (default 5000)")
    p.add_argument("--maxcount", type=int, default=1000, metavar="N", help="samples per shard (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle before writing (default 0)")
    p.add_argument("--label", choices=["json", "cls"], default="json",
                   help='json: the class name, {"label": NAME} (default); cls: the class index')
    p.add_argument("--prefix", default="cifar10", help="shard names: PREFIX-000000.tar (default cifar10)")
    args = p.parse_args(argv)
    p.at_least(args, {"holdout": 0, "maxcount": 1, "seed": 0})
    if not os.path.isdir(args.root):
        p.error(f"{args.root}: no such folder")
    return args


def main(argv=None):
    args = parse_args(argv)  # --help and a bad command line answer before webdataset (and torch) load

    import json

    import webdataset as wds

    classes = sorted(d for d in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, d)))
    files = sorted((os.path.join(c, f), label) for label, c in enumerate(classes)
                   for f in os.listdir(os.path.join(args.root, c)))
    random.Random(args.seed).shuffle(files)  # ImageFolder order is one class after another: shards must mix them
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "classes.txt"), "w") as f:
        f.write("\n".join(classes) + "\n")
    for split, items in (("test", files[:args.holdout]), ("train", files[args.holdout:])):
        if not items:
            continue
        os.makedirs(os.path.join(args.out, split), exist_ok=True)
        pattern = os.path.join(args.out, split, f"{args.prefix}-%06d.tar")
        with wds.ShardWriter(pattern, maxcount=args.maxcount, verbose=0) as sink:
            for rel, label in items:
                with open(os.path.join(args.root, rel), "rb") as f:
                    data = f.read()
                stem, ext = os.path.splitext(rel)
                folder, base = os.path.split(stem)
                key = f"{folder}/{base.replace('.', '_')}"  # a dot in a key would end it: webdataset's rule
                sample = {"__key__": key, ext.lstrip(".").lower(): data}
                if args.label == "json":
                    sample["json"] = json.dumps({"label": classes[label]}).encode()
                else:
                    sample["cls"] = str(label).encode()
                sink.write(sample)
        print(f"{split}: {len(items)} samples -> {os.path.join(args.out, split)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
