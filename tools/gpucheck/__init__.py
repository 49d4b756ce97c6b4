"""The parts of tools/gpu_check.py, one concern a module; the script is the command line and
the plan (which step runs, in what order, within --budget).

    data      the synthetic shards (raw, and JPEG files indexed in place) the steps read
    runner    a step's run and report: PASS/FAIL lines, time limits, the Markdown table
    handover  the loader's hand-over to the device: kept batches never overwritten (bytes
              compared) with copies on the default stream, on a side stream dropped before any
              wait and from a thread; workers started again after the ring was registered; a
              refused page-lock; the loader's rate feeding a model step. Each case takes a
              device, so tests/test_gpu_check.py runs the same cases on "cpu"
    trainer   the trainer under torchrun (the default model and --model resnet18), the model
              alone, and the trainer's synchronising calls
    kernels   bf16 autocast, normalisation on the device, nccl on one rank
    scaling   the stream alone at 0/4/8/cores-2 workers, raw and JPEG, C and C8
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
