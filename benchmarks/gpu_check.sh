#!/usr/bin/env bash
# The GPU check: one command on a CUDA machine without network access.
#
#   benchmarks/gpu_check.sh OUTDIR [SIZE]        (SIZE of the benchmark state, default 8G)
#
# 1. installs the wheels placed in ./.whl/ of what the machine lacks (kvikio-cu13,
#    libkvikio-cu13, rapids-logger, xxhash...: benchmarks/gpu_wheels.sh downloads them
#    where there is network), offline and without dependency resolution;
# 2. builds and installs tensorferry from this tree: pip install --no-build-isolation --no-deps .
# 3. runs the CUDA tests: pytest -m cuda (junit XML in OUTDIR);
# 4. runs every benchmarks/bench_gpu*.py with --size SIZE --dir <this tree's disk> --out OUTDIR/<name>.json;
# 5. merges everything into OUTDIR/gpu_check.json: device name, driver, GDS mode, the
#    tests' counts, each figure with its peers and the fio ceiling of the same run; and
#    the same as markdown, OUTDIR/gpu_check.md. Commit the record of a real run as
#    benchmarks/results/gpu/<UTC stamp>-gpu_check.json (beside, not among, the result
#    files benchmarks/report.py renders).
#
# Every step gets what is left of a 9.5-minute budget (GPU_CHECK_BUDGET seconds), so the
# whole check ends within 10 minutes; the reserves kept for later steps are shares of it,
# so a smaller budget shrinks every step instead of skipping the first ones. A step that
# fails or runs out is recorded, and the steps after it still run where they can. The log
# is OUTDIR/gpu_check.log.
# GPU_CHECK_BENCH_ARGS adds arguments to every benchmark ("--device cpu" tries the whole
# script on a machine without a GPU; its figures then mean nothing).
set -uo pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR [SIZE]}
SIZE=${2:-8G}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-570}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
STEPS=$OUT/gpu_check.steps
BENCH_DIR=${TENSORFERRY_BENCH_DIR:-$ROOT/.gpu-check-tmp}
START=$(date +%s)
: >"$LOG"
: >"$STEPS"
# JAX takes 75% of the GPU's memory at start unless told not to; torch runs in the same tests.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME RESERVE COMMAND...: runs COMMAND with what is left of the budget less RESERVE
# seconds (kept for the steps after it), logs it, records "NAME rc seconds".
step() {
    local name=$1 reserve=$2
    shift 2
    local limit=$(($(left) - reserve))
    if ((limit < 10)); then
        echo "$name skipped 0" >>"$STEPS"
        echo "== $name: skipped, the time budget is spent" >>"$LOG"
        return 1
    fi
    echo "== $name (limit ${limit}s): $*" >>"$LOG"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "$name $rc $(($(date +%s) - t0))" >>"$STEPS"
    echo "== $name: rc=$rc" >>"$LOG"
    return $rc
}

cd "$ROOT" || exit 2
# fio as gpu_wheels.sh builds it, where the machine has none.
[ -x .whl/fio/fio ] && ! command -v fio >/dev/null && export PATH=$ROOT/.whl/fio:$PATH
shopt -s nullglob
# Only wheels of distributions the machine lacks: a newer numpy or ml_dtypes over the
# frameworks' own could break them.
wheels=()
for wheel in .whl/*.whl; do
    dist=$(basename "$wheel" | cut -d- -f1)
    "$PY" -m pip show -q "$dist" >/dev/null 2>&1 || wheels+=("$wheel")
done
if ((${#wheels[@]})); then
    step wheels $((BUDGET * 84 / 100)) "$PY" -m pip install --no-index --no-deps --find-links .whl "${wheels[@]}"
fi
if step build $((BUDGET * 63 / 100)) "$PY" -m pip install --no-build-isolation --no-deps .; then
    # A test module whose framework the machine lacks (and that does not skip itself)
    # must not keep the CUDA tests of the others from running.
    step cuda_tests $((BUDGET * 42 / 100)) "$PY" -m pytest -m cuda tests -q -rs -p no:cacheprovider --continue-on-collection-errors \
        --junitxml="$OUT/cuda_tests.xml"
    mkdir -p "$BENCH_DIR"
    benches=(benchmarks/bench_gpu*.py)
    for i in "${!benches[@]}"; do
        bench=${benches[$i]}
        name=$(basename "$bench" .py)
        # What is left is shared among the benchmarks still to run.
        remaining=$((${#benches[@]} - i))
        share=$(($(left) - 15))
        reserve=$((share - share / remaining + 15))
        # shellcheck disable=SC2086 # GPU_CHECK_BENCH_ARGS is split on purpose
        step "$name" "$reserve" "$PY" "$bench" --size "$SIZE" --dir "$BENCH_DIR/$name" --out "$OUT/$name.json" \
            ${GPU_CHECK_BENCH_ARGS:-}
    done
    rm -rf "$BENCH_DIR"
fi

"$PY" - "$OUT" "$SIZE" "$START" <<'EOF'
import glob, json, os, subprocess, sys, time
import xml.etree.ElementTree as ET

out, size, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
record = {"check": "tensorferry GPU check", "command": f"benchmarks/gpu_check.sh OUTDIR {size}",
          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)), "size": size}
with open(os.path.join(out, "gpu_check.steps")) as f:
    record["steps"] = [{"step": n, "rc": None if rc == "skipped" else int(rc), "seconds": int(s),
                        "timed_out": rc in ("124", "137")} for n, rc, s in (line.split() for line in f)]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
    record["nvidia_smi"] = gpu or None
except (OSError, subprocess.SubprocessError):
    record["nvidia_smi"] = None
try:
    suite = ET.parse(os.path.join(out, "cuda_tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    record["cuda_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    record["cuda_tests"]["skipped_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
    cases = list(suite.iter("testcase"))
    broken = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    uncollected = [c for c in broken if "collection failure" in (c.find("error").get("message", "")
                                                                  if c.find("error") is not None else "")]
    record["cuda_tests"]["failed"] = [c.get("classname", "") + "::" + c.get("name", "") for c in broken
                                      if c not in uncollected]
    record["cuda_tests"]["not_collected"] = [c.get("classname", "") + "::" + c.get("name", "") for c in uncollected]
except (OSError, ET.ParseError, AttributeError):
    record["cuda_tests"] = None
record["benchmarks"], record["figures"] = {}, []
for path in sorted(glob.glob(os.path.join(out, "bench_gpu*.json"))):
    name = os.path.basename(path)[:-5]
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        record["benchmarks"][name] = {"error": f"unreadable: {exc}"}
        continue
    record["benchmarks"][name] = {k: v for k, v in result.items() if k != "figures"}
    for figure in result.get("figures", []):
        record["figures"].append({"benchmark": name, **figure})
    gpu = result.get("gpu") or {}
    for key in ("name", "driver", "gds_mode", "kvikio", "torch", "torch_cuda"):
        if gpu.get(key) is not None:
            record.setdefault("device", {})[key] = gpu[key]
record["seconds"] = int(time.time() - start)
# pytest's rc is 1 when a module could not be collected: judged by the failures themselves.
record["passed"] = (all(s["rc"] == 0 for s in record["steps"] if s["step"] != "cuda_tests")
                    and bool(record["cuda_tests"])
                    and record["cuda_tests"]["tests"] > record["cuda_tests"]["skipped"]
                    and not record["cuda_tests"]["failed"])
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(record, f, indent=1)
print(json.dumps({k: record.get(k) for k in ("device", "nvidia_smi", "cuda_tests", "steps", "seconds", "passed")},
                 indent=1))

EOF
# The same record as markdown, by the renderer docs/gpu.md is generated with.
"$PY" benchmarks/report.py --gpu-check "$OUT/gpu_check.json" >"$OUT/gpu_check.md" && cat "$OUT/gpu_check.md"
