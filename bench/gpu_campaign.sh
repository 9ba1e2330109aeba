#!/usr/bin/env bash
# The GPU campaign (issue 14): the stack where its users run it, on one CUDA GPU, in one or two device calls.
#
#   bash bench/gpu_campaign.sh [PHASE ...]      PHASE: timing mfu tests (default: all three, in that order)
#
# A session's 15 device minutes hold two calls, the machine's start (~30 s) included:
#   run(command="BUDGET_S=450 bash bench/gpu_campaign.sh tests", carry=[".whl", ".carry"], timeout_s=480)
#   run(command="BUDGET_S=<budget_left_s - 60> bash bench/gpu_campaign.sh timing mfu", same carry)
# (the second call, made at once, finds the first's machine still warm; a fresh start needs 4 minutes or more left).
# The tests go first: on the H200 (2026-11-29) the suite had 1449 of 1608 results after 240 s beside the background
# runs, so it needs ~300 s or more. A step's limit is a cap, not a reservation: the timing and MFU caps add up to 615 s,
# so when the early steps run to their caps the last ones get what is left or are skipped (the compiled MFU runs,
# which are therefore last: optional). Every step starts only with 20 s or more left and keeps what it finished.
#
#   timing  alone on the GPU, in this order: head groups at T = 1k/8k/4k, 65536 tokens per step (bench/heads.py
#           --device cuda, bf16 autocast), the IsoFLOP pair's training steps under Lightning's PyTorch profiler
#           (operators by CUDA time), then the IsoFLOP pair and MoSA Table 2's Tiny pair (bench/resources.py,
#           T = 1024, batch 64, bf16)
#   mfu     dense Tiny and Small trained on C4 (bf16, eager and compiled), MFU from their logs (flops.mfu)
#   tests   `make test` with CUDA (Triton compiled, no interpreter; pytest-xdist when installed; the CUDA test
#           files first, tests/conftest.py), and beside it,
#           runs that need correctness but no clean timing: DeepSpeed ZeRO-2 and DDP, each stopped by SIGTERM
#           half-way and resumed (bench/resume_check.py; the ZeRO-2 checkpoint then made one file by lm.consolidate
#           and read by lm.generate), and a short C4 run of dense Tiny vs the IsoFLOP MoSA
#           hybrid (4 dense + 276 MoSA heads, rho 32) with their validation curves in one PNG (lm/plots.py)
#
# A training run that finished in an earlier call on the same warm machine is not rerun.
# Inputs, made on the CPU machine first by bench/gpu_campaign_inputs.sh and carried (git-ignored): .whl/ (wheels
# of what the GPU image lacks: deepspeed, datasets, omegaconf and their missing dependencies), .carry/c4 (prepared
# C4) and .carry/shared_data (a copy of ../shared/data, which the tests read). Results go to $OUT/campaign.tgz
# (re-packed after every step, so a call stopped at its limit still returns what finished) and the log to
# $OUT/campaign.log; back on the CPU machine `python -m bench.gpu_campaign_results <each call's campaign.tgz>` turns
# them into bench/results/gpu_*.md. BUDGET_S (default 560) is this call's time: a step that cannot finish in what
# is left is skipped, and says so. BACKGROUND=0 leaves out the runs beside the tests (measured on 2026-11-29; their
# earlier reports are then kept), so that the tests finish sooner and the next call has more of the session's time.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_campaign_out}
BUDGET_S=${BUDGET_S:-560}
BACKGROUND=${BACKGROUND:-1}  # 0: the tests phase runs the tests alone (no ZeRO-2/DDP resume checks, no C4 runs)
END=$(( $(date +%s) + BUDGET_S ))
C=/tmp/campaign            # result files (packed into $OUT/campaign.tgz)
R=/tmp/campaign_runs       # run directories (checkpoints stay here)
mkdir -p "$OUT" "$C" "$R"
exec > >(tee -a "$OUT/campaign.log") 2>&1
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
PHASES=${*:-timing mfu tests}
DATA=.carry/c4
[ -d .carry/shared_data ] && export SHARED_DATA=$PWD/.carry/shared_data  # ../shared/data for the tests (carried copy)

left() { echo $(( END - $(date +%s) )); }
pack() { tar czf "$OUT/campaign.tgz.part" -C "$(dirname $C)" "$(basename $C)" && mv "$OUT/campaign.tgz.part" "$OUT/campaign.tgz"; }
# step NAME SECONDS COMMAND...: run COMMAND under a time limit of SECONDS (less if less is left), log its status
step() {
    local name=$1 want=$2; shift 2
    local have=$(( $(left) - 15 ))
    if (( have < 20 )); then echo "== $name: SKIPPED ($have s left)"; echo "$name skipped" >> $C/status.txt; return; fi
    local limit=$(( want < have ? want : have )) t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    # SIGINT at the limit: pytest and Lightning stop and still report what they did
    timeout -s INT -k 10 "$limit" "$@"; local rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s"
    echo "$name exit $rc $(( $(date +%s) - t0 ))s" >> $C/status.txt
    pack
}

echo "== campaign $(date -u +%FT%TZ), phases: $PHASES, budget ${BUDGET_S}s"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| triton', triton.__version__, '| cuDNN', torch.backends.cudnn.version(), '|', torch.cuda.get_device_name(0))"
    python3 -m pip list 2>/dev/null | grep -i -E "^(lightning|deepspeed|datasets|pytest|pytest-xdist|flash.attn|numpy|sentencepiece|omegaconf|pyarrow|fsspec|protobuf) "
    nproc; free -g | head -2
} > $C/environment.txt 2>&1
cat $C/environment.txt

# `make test` as on any machine; the GPU image has its own Python with torch: a stand-in .venv for make
VENV=/tmp/gpu_venv
mkdir -p $VENV/bin && printf '#!/bin/sh\nexec python3 "$@"\n' > $VENV/bin/python && chmod +x $VENV/bin/python && touch $VENV/.installed

train() {  # train NAME CONFIG OVERRIDES...: train_lm.py into $R/NAME, keep its metrics, curve and log
    local name=$1 config=$2; shift 2
    [ -f $R/$name/.campaign_done ] && { echo "$name: done in an earlier call"; return 0; }
    local command=(python3 train_lm.py --config "$config" data.path=$DATA trainer.out_dir=$R/$name --overwrite "$@")
    local a line=""
    for a in "${command[@]}"; do [[ $a =~ ^[A-Za-z0-9_./=:,+-]+$ ]] && line+=" $a" || line+=" ${a@Q}"; done  # shell-quoted
    echo "== $name (run):$line" > $C/$name.log  # the exact command line, for the report (gpu_campaign_results)
    "${command[@]}" >> $C/$name.log 2>&1
    local rc=$?
    (( rc == 0 )) && touch $R/$name/.campaign_done  # metrics.json alone also marks a run stopped after a validation
    cp $R/$name/metrics.json $C/$name.metrics.json 2>/dev/null; cp $R/$name/val_curve.png $C/$name.png 2>/dev/null
    tail -3 $C/$name.log
    return $rc
}
background_checks() {  # ZeRO-2, then DDP: stopped by SIGTERM half-way and resumed, vs uninterrupted
    local strategy
    for strategy in deepspeed_stage_2 ddp; do
        python3 -m bench.resume_check --config configs/tiny.yaml --steps 50 --work $R/resume_$strategy \
            --out $C/resume_$strategy.md data.path=$DATA trainer.strategy=$strategy data.batch_size=16 \
            data.val_batches=4 optim.warmup_steps=10 > $C/resume_$strategy.log 2>&1
        echo "resume_check $strategy exit $?" >> $C/status.txt
        for f in $R/resume_$strategy/*.log; do cp "$f" "$C/resume_${strategy}_$(basename "$f")"; done 2>/dev/null
    done
    consolidate $R/resume_deepspeed_stage_2/resumed/checkpoints/last.ckpt > $C/deepspeed_consolidate.md 2>&1
    echo "consolidate exit $?" >> $C/status.txt
}
consolidate() {  # the DeepSpeed run's sharded checkpoint made one file (lm.consolidate), then read by lm.generate
    local file=$R/deepspeed_consolidated.ckpt
    echo "\`python -m lm.consolidate $1 $file\`, then \`python -m lm.generate --ckpt $file --prompt The --max-new-tokens 20 --temperature 0\`:"
    echo; echo '```'
    python3 -m lm.consolidate $1 $file > $R/consolidate.out 2>&1
    local rc=$?
    tail -4 $R/consolidate.out
    if (( rc == 0 )); then
        python3 -m lm.generate --ckpt $file --prompt The --max-new-tokens 20 --temperature 0 > $R/generate.out 2>&1
        rc=$?
        tail -4 $R/generate.out
    fi
    echo '```'
    return $rc
}
ISOFLOP_HEADS="model.heads=[{type: dense, count: 4}, {type: mosa, count: 276, options: {sparsity: 32}}]"  # Tiny
profile() {  # where the IsoFLOP pair's step time goes (MoSA 3.2x dense's on the H200, 2026-11-29): 3 training steps
    # of each (batch 64, T = 1024, bf16, C4) under trainer.profiler=pytorch, its operator table (by CUDA time)
    local run=(data.batch_size=64 data.val_batches=1 optim.warmup_steps=2 trainer.max_steps=6 trainer.val_every=1000
               trainer.ckpt_every=1000 trainer.log_every=2 trainer.profiler=pytorch) name
    train profile_mosa_isoflop configs/tiny.yaml "${run[@]}" "$ISOFLOP_HEADS"  # first: the one in question
    train profile_dense configs/tiny.yaml "${run[@]}"
    for name in profile_dense profile_mosa_isoflop; do
        [ -f $R/$name/profile/fit-pytorch.txt ] || continue
        { echo "## $name"; echo; echo '```'; cat $R/$name/profile/fit-pytorch.txt; echo '```'; } > $C/$name.md
    done
}
c4_runs() {  # side by side (the same GPU contention): equal steps and tokens, curves against tokens
    local run=(data.batch_size=16 data.val_batches=6 optim.lr=1e-3 optim.warmup_steps=30 trainer.max_steps=250
               trainer.val_every=25 trainer.ckpt_every=1000 trainer.log_every=25 trainer.max_minutes=2)
    (train c4_dense configs/tiny.yaml "${run[@]}"; echo "c4_dense exit $?" >> $C/status.txt) &
    (train c4_mosa_isoflop configs/tiny.yaml "${run[@]}" "$ISOFLOP_HEADS"
     echo "c4_mosa_isoflop exit $?" >> $C/status.txt) &
    wait
    python3 -m lm.plots $R/c4_dense $R/c4_mosa_isoflop --out $C/c4_dense_vs_mosa.png \
        --title "C4, Tiny: dense 9 vs 4 + 276 MoSA (rho 32), equal FLOPs"
}
salvage() {  # what runs stopped at the budget wrote so far: their metrics, curves and logs
    local r
    for r in $R/c4_*; do
        [ -f $C/$(basename $r).metrics.json ] || cp $r/metrics.json $C/$(basename $r).metrics.json 2>/dev/null
        [ -f $C/$(basename $r).png ] || cp $r/val_curve.png $C/$(basename $r).png 2>/dev/null
    done
    for r in $R/resume_*; do for f in $r/*.log; do cp "$f" "$C/$(basename $r)_$(basename "$f")"; done 2>/dev/null; done
}
export -f train background_checks consolidate c4_runs profile; export DATA R C ISOFLOP_HEADS

for phase in $PHASES; do case $phase in
tests)
    if (( BACKGROUND )); then
        setsid bash -c background_checks & checks=$!  # own process groups: killed whole if they overrun
        setsid bash -c c4_runs & c4=$!
    fi
    # what the run should cover (gpu_tests.md lists the files whose collected tests did not all get a result)
    python3 -m pytest --collect-only -q -q -p no:cacheprovider tests 2>/dev/null | grep -E '^tests/\S+\.py: [0-9]+$' \
        > $C/collected.txt
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12")
    TESTS_S=$(( $(left) - 40 * BACKGROUND ))  # all but the wait for the checks beside it (on the H200, 16 cores: > 240 s)
    # pytest-timeout >= 2.3 ends the session between tests 30 s before that, in time to print its summary and write
    # the junit file (on the H200, timeout's SIGINT and then SIGKILL stopped it at the step's limit instead)
    SESSION=$(python3 -m pytest --help 2>/dev/null | grep -q session-timeout && echo "--session-timeout $(( TESTS_S > 50 ? TESTS_S - 30 : 20 ))")
    export PYTEST_ADDOPTS="$XDIST $SESSION --timeout 150 -p no:cacheprovider --junitxml=$C/tests.xml --durations=25"
    if command -v make >/dev/null; then
        step make-test $TESTS_S make test VENV=$VENV -o $VENV/.installed > $C/tests.log 2>&1  # -o: the stand-in stays
    else  # what `make test` runs, where the image has no make
        step make-test $TESTS_S env TRITON_INTERPRET=0 python3 -m pytest tests > $C/tests.log 2>&1
    fi
    unset PYTEST_ADDOPTS
    tail -30 $C/tests.log
    if (( BACKGROUND )); then
        step wait-background 200 bash -c "while kill -0 $checks 2>/dev/null || kill -0 $c4 2>/dev/null; do sleep 1; done"
        kill -KILL -- -$checks -$c4 2>/dev/null  # overran: a training run defers SIGTERM to the end of its step
        salvage
        cat $C/resume_*.md 2>/dev/null
    fi
    ;;
timing)
    # bench/resources.py rewrites its table after every round, bench/heads.py after every T: a step stopped at its
    # limit keeps what it finished
    # The head groups first: every gathered-head path changed since the H200 run of 2026-11-29 is timed side by side
    # there. The 5 dense heads the IsoFLOP model replaces; mosa-threshold takes the whole-head kernels where they fit
    # (c <= 64; <= 128 on H100/H200) and the tiled kernels beyond (c = 256 at T = 8192); mosa-column-grid: the Triton
    # scatter's grid before 2026-12-01 (a program per column block), against its column loop; mosa-tiled: the tiled
    # kernels for every head; mosa-lean: the lean PyTorch core, to see which is fastest at each T; 150 s for five
    # variants (120 s for four before 2026-12-01). 65536 tokens per step at every T, training's load (batch 64 at
    # T = 1024, 8 at 8192, 16 at 4096): the run of 2026-11-29 timed batch 4 (4096 tokens at T = 1024: 1.67x dense's
    # time, where the whole IsoFLOP model at batch 64 took 3.2x dense's). The IsoFLOP point T = 1024 first (the
    # measured defect), then T = 8192, the tiled kernels' case (the run of 2026-11-29 never reached it): the larger
    # batches make each T take longer, and a step stopped at its cap keeps the lengths it finished
    step heads 150 python3 -m bench.heads --device cuda --d-model 512 --head-dim 64 --dense-heads 5 \
        --variants dense mosa-threshold mosa-column-grid mosa-tiled mosa-lean --T 1024 8192 4096 --tokens 65536 \
        --repeats 5 --out $C/gpu_heads.md
    # Then where the IsoFLOP model's step time goes (operators by CUDA time), before the two resource pairs: Table 2's
    # and the IsoFLOP pair's step times were measured on 2026-11-29 (before the kernel changes since and training's
    # fused AdamW, so not comparable with new runs), the profile never (a profile cut short has no table, so it gets
    # its whole cap while there is time)
    step profile 120 bash -c profile
    # one round each: on the H200, two rounds and the first Triton compiles overran 55 s; one round took 28 s
    step isoflop 70 python3 -m bench.resources --pair isoflop-tiny --seq-len 1024 --batch 64 --device cuda \
        --rounds 1 --warmup 3 --steps 10 --out $C/gpu_isoflop_resources.md
    step table2 70 python3 -m bench.resources --pair table2-tiny --seq-len 1024 --batch 64 --device cuda \
        --rounds 1 --warmup 3 --steps 10 --out $C/gpu_table2.md
    ;;
mfu)
    MFU=(data.val_batches=1 optim.warmup_steps=10 trainer.max_steps=60 trainer.log_every=10 trainer.val_every=60 trainer.ckpt_every=1000)
    # Tiny compiled first: the one run the H200 campaign of 2026-11-29 did not finish (39 s of budget left); a phase
    # cut short keeps the earlier campaign's rows of the runs it did not reach (bench/gpu_campaign_results.mfu_report)
    step mfu_tiny_compiled 90 bash -c 'train "$@"' _ mfu_tiny_compiled configs/tiny.yaml "${MFU[@]}" trainer.compile=true
    step mfu_tiny_eager 40 bash -c 'train "$@"' _ mfu_tiny_eager configs/tiny.yaml "${MFU[@]}"
    step mfu_small_eager 45 bash -c 'train "$@"' _ mfu_small_eager configs/small.yaml "${MFU[@]}"
    step mfu_small_compiled 90 bash -c 'train "$@"' _ mfu_small_compiled configs/small.yaml "${MFU[@]}" trainer.compile=true
    done=$(for r in $R/mfu_*; do [ -f $r/.campaign_done ] && echo $r; done)  # one unfinished run would void the table
    [ -n "$done" ] && timeout 25 python3 -m flops.mfu $done > $C/gpu_mfu.md 2>&1; cat $C/gpu_mfu.md
    ;;
*) echo "unknown phase $phase (timing, mfu, tests)"; exit 2;;
esac; pack; done
echo "== done, $(left)s of the budget left"; cat $C/status.txt
pack
