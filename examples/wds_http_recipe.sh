#!/usr/bin/env bash
# Somebody else's JPEG WebDataset next to MNIST: written with wds.ShardWriter (class names in .json),
# indexed in place (both splits in one command, so the test split maps names as training does),
# served over HTTP on 127.0.0.1 and trained on from its URL; then the report. The recipe of
# docs/training.md ("The same with class names, served over HTTP").
#
#   examples/wds_http_recipe.sh CIFAR10_JPEGS/train MNIST_ROOT CIFAR10_WDS runs/wds-names
#
# Environment: PORT (8000), CACHE (/tmp/shard-cache), HOLDOUT (5000), EPOCHS (5), NPROC (2), PY (.venv/bin/python if there,
# else python), MNIST_ARGS (default "--datasets mnist --root MNIST_ROOT"; e.g.
# "--synthetic --datasets mnist --limit 600" to try it offline), TRAIN_ARGS (extra trainer flags).
set -euo pipefail
[ $# -eq 4 ] || { echo "usage: $0 IMAGEFOLDER_TRAIN MNIST_ROOT OUT_WDS RUN_DIR" >&2; exit 2; }
src=$1 mnist_root=$2 wds=$3 run=$4
PORT=${PORT:-8000} HOLDOUT=${HOLDOUT:-5000} EPOCHS=${EPOCHS:-5} NPROC=${NPROC:-2}
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi; fi
MNIST_ARGS=${MNIST_ARGS:---datasets mnist --root $mnist_root}
url=http://127.0.0.1:$PORT/

"$PY" tools/write_wds.py "$src" "$wds" --holdout "$HOLDOUT"                 # .json {"label": NAME}
"$PY" tools/make_shards.py --index cifar10:train="$wds/train" --index cifar10:test="$wds/test" --out "$wds"
# shellcheck disable=SC2086  # MNIST_ARGS is a list of flags
"$PY" tools/make_shards.py $MNIST_ARGS --out "$wds"
"$PY" -m http.server "$PORT" --bind 127.0.0.1 --directory "$wds" >/dev/null 2>&1 &
server=$!
trap 'kill "$server"' EXIT
sleep 1
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
"$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m pipeline.train \
    --train mnist=$url --train cifar10=$url --eval mnist=$url --eval cifar10=$url \
    --epochs "$EPOCHS" --batch-size 128 --workers 1 --width 16 --cache-dir "${CACHE:-/tmp/shard-cache}" --out "$run" ${TRAIN_ARGS:-}
"$PY" tools/report.py "$run"
