"""The trainer: `python -m pipeline.train` (or under torchrun) runs `pipeline.train.loop`.

This file stays free of heavy imports so that the package can be found cheaply."""
