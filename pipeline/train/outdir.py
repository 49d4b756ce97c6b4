"""Output folder: what a run may find in --out, and what it may delete there.

Apart from the training so that the one rule that deletes files (a run clears only a
folder that holds nothing but a run's files) sits in one place, next to the list of
the files a run writes.
"""
import os
import re

from pipeline.errors import InputError
from pipeline.train import dist, guard, options


def prepare_out(args, topo):
    """Refuse to overwrite a previous run unless told; returns the checkpoint to resume, if any.

    After torchrun restarts a failed job (--max-restarts), the run in --out is this
    job's own: continue from its checkpoint, or start over if it never wrote one.
    """
    ckpt = os.path.join(args.out, "checkpoint.pt")
    previous = os.path.exists(os.path.join(args.out, "metrics.jsonl")) or os.path.exists(ckpt)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    either = getattr(args, "resume_or_start", False)
    if args.resume or ((restarted or either) and os.path.exists(ckpt)):
        if not os.path.exists(ckpt):
            raise InputError(options.resume_error(args))
        return ckpt
    if previous and either and not (args.overwrite or restarted):  # an earlier run's files, not this job's
        raise InputError(guard.earlier_run(args.out, run_files(args.out, "--resume-or-start")))
    if previous and not (args.overwrite or restarted or either):
        raise InputError(f"{args.out} holds a previous run; pass --resume to continue it or --overwrite to replace it")
    why = ("--overwrite" if args.overwrite else "restarted without a checkpoint" if restarted else
           "--resume-or-start without a checkpoint" if either else "--out")
    # a run starts only in a folder that holds nothing but a run's files, so --overwrite can always clear it;
    # without a previous run or --overwrite, a run's stray files (a keys-rank0.txt) are left alone
    found = run_files(args.out, why) if os.path.isdir(args.out) else []
    doomed = found if previous or args.overwrite else []
    dist.barrier()  # every rank has looked before rank 0 clears the folder
    if topo.is_main:
        if doomed:
            print(f"{why}: deleting the previous run in {args.out}/: {', '.join(doomed)}", flush=True)
        for name in doomed:
            os.remove(os.path.join(args.out, name))
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    return None


RUN_FILE = re.compile(r"(metrics\.jsonl|summary\.json|checkpoint\.pt|eval\.json|report\.png|keys-rank\d+\.txt)"
                      r"(\.tmp)?\Z")  # what train, --eval-only and tools/report.py write into --out


def run_files(folder, why="--overwrite"):
    """The files of a previous run in `folder`, to delete; InputError if anything else is there
    (shards, manifests, folders, a mistyped --out): a run writes only into a folder of its own,
    and --overwrite deletes only what a run wrote."""
    names = sorted(n for n in os.listdir(folder) if n != guard.LOCK)  # the running trainer's own lock
    for name in names:
        path = os.path.join(folder, name)
        if not RUN_FILE.match(name) or os.path.islink(path) or not os.path.isfile(path):
            raise InputError(f"{why}: {folder} holds {name!r}, which no run of pipeline.train writes; "
                             f"nothing deleted (choose another --out, or empty the folder yourself)")
    return names
