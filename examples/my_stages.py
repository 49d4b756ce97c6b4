"""A stage of your own for --sample-stage, run on every decoded training sample in the workers.

    PYTHONPATH=examples torchrun --nproc_per_node=2 -m pipeline.train ... --sample-stage my_stages:invert

A sample is {"__key__", "__source__", "image": uint8 C,H,W array, "label": int, "__seed__": int};
return it (the image keeping its shape and dtype) or None to drop it. Draw any randomness from
`__seed__` (a pure function of where the sample stands in its slot): a resumed run, on any
number of GPUs, then draws the same for the same sample.
"""
import numpy as np


def invert(sample):
    """Negative CIFAR10 images; other sources pass unchanged."""
    if sample["__source__"] == "cifar10":
        sample["image"] = 255 - sample["image"]
    return sample


def flip(sample):
    """Mirror half the images left to right, the half chosen by each sample's seed."""
    if np.random.default_rng(sample["__seed__"]).random() < 0.5:
        sample["image"] = np.ascontiguousarray(sample["image"][:, :, ::-1])
    return sample


if __name__ == "__main__":  # a module of stages, not a program: --help says how to use it
    import argparse

    argparse.ArgumentParser(prog="my_stages", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(__doc__.strip().splitlines()[0])
