"""A stage of your own for --sample-stage, run on every decoded training sample in the workers.

    PYTHONPATH=examples torchrun --nproc_per_node=2 -m pipeline.train ... --sample-stage my_stages:invert

A sample is {"__key__", "__source__", "image": uint8 C,H,W array, "label": int}; return it (the
image keeping its shape and dtype) or None to drop it.
"""


def invert(sample):
    """Negative CIFAR10 images; other sources pass unchanged."""
    if sample["__source__"] == "cifar10":
        sample["image"] = 255 - sample["image"]
    return sample
