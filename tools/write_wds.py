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
import stat
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.cli import Parser, printable  # noqa: E402
from pipeline.errors import ShardError  # noqa: E402
from pipeline.files import SPECIAL, open_regular  # noqa: E402


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
    root, out = os.path.realpath(args.root), os.path.realpath(args.out)
    if out == root or out.startswith(root.rstrip(os.sep) + os.sep):
        p.error(f"OUT {args.out} is ROOT {args.root} or inside it: the shards would land in the image tree "
                f"(and be read as a class next time); choose a folder outside ROOT")
    return args


def listing(root):
    """([(ROOT-relative image path, class index)], class names): every regular file in each class
    folder. Anything else there (a folder, a FIFO, a device) is skipped with one line on stderr:
    ImageFolder is ROOT/<class>/<image>, and opening a FIFO would wait forever."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    for c in classes:
        if not c.isprintable():
            raise ShardError(f"class folder '{printable(c)}' in {root}: its name holds a newline or another control "
                             f"character, which classes.txt (one name a line) cannot hold; rename the folder")
    files = []
    for label, c in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(root, c))):
            path = os.path.join(root, c, f)
            try:
                mode = os.stat(path).st_mode
            except OSError as e:  # a dangling link
                print(f"write_wds: skipping {printable(path)}: {e.strerror}", file=sys.stderr)
                continue
            if not stat.S_ISREG(mode):
                what = next((name for test, name in SPECIAL if test(mode)), "not a regular file")
                print(f"write_wds: skipping {printable(path)}: {what}, not an image file", file=sys.stderr)
                continue
            files.append((os.path.join(c, f), label))
    return files, classes


def main(argv=None):
    args = parse_args(argv)  # --help and a bad command line answer before webdataset (and torch) load
    try:
        return write(args)
    except (ShardError, OSError) as e:
        print(f"write_wds: error: {printable(e)}", file=sys.stderr)
        return 2


def write(args):
    import json

    import webdataset as wds

    files, classes = listing(args.root)
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
                with open_regular(os.path.join(args.root, rel)) as f:  # swapped for a FIFO since listed: refused
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
