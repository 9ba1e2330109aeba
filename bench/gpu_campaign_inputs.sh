#!/usr/bin/env bash
# Inputs of bench/gpu_campaign.sh, made on the CPU machine before the device calls (about a minute), in
# git-ignored folders that both calls carry (carry=[".whl", ".carry"]; the two calls: gpu_campaign.sh's header).
#
#   bash bench/gpu_campaign_inputs.sh [SHARED_DATA]      (default ../shared/data)
#
# .whl/          wheels for the GPU image (Python 3.12, x86-64) of what it lacks: deepspeed (PyPI has only its
#                source; built here as a pure-Python wheel, ops compiled on first use), datasets, omegaconf, and
#                their dependencies missing there (dill, multiprocess, hjson, pydantic and its three), plus the
#                typing_extensions that pydantic needs; versions as in .venv
# .carry/c4      C4 from SHARED_DATA/c4 prepared as for training (SentencePiece 8000, 5% validation)
# .carry/shared_data   a copy of SHARED_DATA for the tests (../shared does not travel to the device)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${1:-../shared/data}
PY=.venv/bin/python
[ -x $PY ] || { echo "error: no .venv here: run make install first" >&2; exit 2; }
[ -d "$SHARED/c4" ] || { echo "error: $SHARED/c4 not found (the shared data directory)" >&2; exit 2; }
version() { $PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

rm -rf .whl && mkdir .whl
BINARY=(datasets dill multiprocess hjson pydantic pydantic_core annotated-types typing-inspection omegaconf
        typing_extensions)  # not protobuf: a newer runtime than the image's TensorBoard was built for could break it
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl $(for p in "${BINARY[@]}"; do echo "$p==$(version $p)"; done)
$PY -m pip wheel -q --no-deps -w .whl "deepspeed==$(version deepspeed)"

rm -rf .carry/c4 .carry/shared_data && mkdir -p .carry
$PY -m data_prep.prepare --source c4 --src "$SHARED/c4" --out .carry/c4 --val-fraction 0.05 --no-progress
cp -r "$SHARED" .carry/shared_data && chmod -R u+w .carry/shared_data
du -sh .whl .carry
ls .whl
