#!/usr/bin/env bash
# The GPU checks in one go, for a lent GPU machine that has no network (see README, "Status": "On a GPU"):
#
#   bash tools/gpu_check.sh tests   the test suite (or TESTS="files") with CUDA visible (gloo ranks stay on the CPU)
#   bash tools/gpu_check.sh onegpu  the same, each multi-rank test run as one NCCL rank on the GPU
#                                   (HETERO_TESTS_ONE_RANK=nccl, [Note: a multi-rank test as one rank] in tests/dist.py);
#                                   tests one rank cannot stand for are skipped: every failure is the GPU's
#   bash tools/gpu_check.sh smoke   a small run of every configuration of benchmarks/gpu_race.py; DeepSpeed's ops
#                                   are built first
#   bash tools/gpu_check.sh race    benchmarks/gpu_race.py at its default size, nothing else running
#   bash tools/gpu_check.sh nvme    benchmarks/nvme_bandwidth.py on the machine's disk, 1 GiB and 4 GiB (NVME_SIZES),
#                                   against fio
#   bash tools/gpu_check.sh waits   tools/gpu_waits.py: where hetero's step makes the host wait for the GPU
#   bash tools/gpu_check.sh build   DeepSpeed's CPU Adam and aio ops only (beside another phase: `build & waits`)
#   bash tools/gpu_check.sh all     smoke, then race
#
# Measured on one H200 (2026-11-26): the suite takes longer than 230 s on its 16 cores with 12 workers; the race at
# its default size about 330 s, the NVMe configurations most of it. On one H100 (2026-11-26): eight configurations of
# the race 390 s (DeepSpeed's CPU Adam build 73 s of it: DS_PREBUILD=1 builds its ops first, outside the timings).
# On one H100 again: nine configurations with deepspeed_nvme took more than 390 s after the build; the nvme phase at
# 1 GiB about 60 s; the eight test files that had failed there 85 s. The machine's start took about 30 s.
# On one H100 (2026-11-27), one call of 482 s: four test files beside DeepSpeed's op build 106 s (the build 150 s),
# the race's deepspeed_nvme, hetero_nvme, hetero_nvme_delayed, fsdp2 and hetero 248 s, the nvme phase at 4 GiB 84 s.
# The machine returns 8 files at most: that call's race.json did not come back (race.err holds each result); the
# failed tests now go to the end of pytest.log instead of a file of their own.
# On one H100 (2026-11-27, thirteenth session), one call of 457 s: three test files and a script beside DeepSpeed's
# op build 147 s, the same five race configurations 248 s, fio 2 GiB three ways 5 s, update_stream.py (two runs) 57 s.
# On one H100 (2026-11-28, eighteenth session), one call of 427 s: `build &` beside `waits` (the build about 150 s),
# then seven race configurations 260 s; a second call: five test files 79 s, then the nvme phase at 4 GiB.
# On one H200 (2026-11-28, twenty-third session), one call of 424 s: `build &` and `waits &` (done in under a minute)
# beside eight test files (TESTS_TIMEOUT=200 cut off one stand-in test), then four NVMe race configurations 204 s;
# the same machine again at once (warm): five device and offload configurations 154 s. A third call on a fresh
# machine, 193 s: `waits`, then hetero_nvme_delayed and hetero_nvme_predicted; a third configuration did not fit.
# On one H200 (2026-11-29, thirtieth session), three calls: `waits &` beside `onegpu` (TESTS_TIMEOUT=320: 663 of the
# 934 tests ran, 12 workers, ranks spawned), 337 s; then, warm, `race` with six device and host configurations
# (155 s) and the nvme phase at 4 GiB, 246 s; a fresh machine for 88 chosen tests (TESTS from a file), 188 s.
# On one H200 (2026-11-30, thirty-second session), three calls, 763 s of 900: `build &` and `waits &` (fp16 half
# included) beside `onegpu` with TESTS="tests/test_zero.py tests/test_tiling.py tests/test_tile_turns.py
# tests/test_reduce_points.py tests/test_overflow_on_device.py" (104 tests, 133 s), then four race configurations
# (DeepSpeed's NVMe and offload and hetero's), 433 s; warm, four more (fsdp2, hetero, their offloads) 133 s; a fresh
# machine for hetero_nvme alone and the nvme phase at 1 GiB, 107 s. A configuration run after DeepSpeed's NVMe one on
# the same disk ran slower (7.3 s against 5.4 s first on a fresh machine): RACE_ARGS="--rounds 2 ..." alternates the
# order (gpu_race.py keeps each configuration's fastest round), at twice the time.
#
# Results go to $OUT (default /tmp/gpu_out). Packages the machine lacks travel as wheels in .whl/, libaio for
# DeepSpeed's aio op as .deb files in .debs/, and a static fio in .tools/; all are optional, about 9 MiB together.
# Made on the 2-core VM (Python 3.12 wheels for the image), all three ignored through .git/info/exclude:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic \
#     typing-extensions hjson xxhash einops msgpack py-cpuinfo ninja nvidia-ml-py   (--no-deps for all but pydantic)
#   DS_BUILD_OPS=0 .venv/bin/pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
#   apt-get download libaio1 libaio-dev   (into .debs)
#   fio: `apt-get source fio` (a deb-src line added), `./configure --build-static --disable-native` with the optional
#     engines off (numa, rdma, rados, rbd, http, gfapi, libnfs, pmem, xnvme, libzbc, tcmalloc, dfs), make, strip
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
PHASE=${1:-all}
case "$PHASE" in
  tests | onegpu | smoke | race | nvme | waits | build | all) ;;
  *)  # a typo would otherwise spend a lent machine's start on nothing
    echo "gpu_check.sh: unknown phase '$PHASE'; choose tests, onegpu, smoke, race, nvme, waits, build or all" >&2
    exit 2
    ;;
esac
NV=${NVME_DIR:-/tmp/hetero_gpu_nvme}
mkdir -p "$OUT" "$NV"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# DeepSpeed's op builder reads this as numbers and fails on an image's "9.0a": the GPU's plain capability instead.
TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null) &&
  export TORCH_CUDA_ARCH_LIST
# Phases may run side by side (DeepSpeed's build beside `waits`): one installs, the others wait for it.
exec 9>/tmp/gpu_check.lock
flock 9
if compgen -G ".whl/*.whl" >/dev/null; then
  # Once a machine: a second call's reinstall would replace files under a DeepSpeed build still importing them.
  if [ -e /tmp/site/.installed ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl; then
    touch /tmp/site/.installed
    export PYTHONPATH=$PWD:/tmp/site
  fi
fi
if compgen -G ".debs/*.deb" >/dev/null; then
  for f in .debs/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
flock -u 9

{
  date -u
  nvidia-smi
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
  nproc
  free -g
  df -h "$NV"
  lsblk -d -o NAME,ROTA,SIZE,MODEL
  grep -i -E "huge|MemTotal" /proc/meminfo
  cat /sys/kernel/mm/transparent_hugepage/enabled
} >"$OUT/env.txt" 2>&1

# DeepSpeed's CPU Adam and aio ops, built outside any timing; its log in $OUT/ds_build.log.
build_deepspeed() {
  timeout 240 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder
CPUAdamBuilder().load(); print('cpu_adam built')
AsyncIOBuilder().load(); print('async_io built')" >"$OUT/ds_build.log" 2>&1
  echo "build exit $?" >>"$OUT/ds_build.log"
}

if [ "$PHASE" = onegpu ]; then
  # Ranks spawned, not forked from a server: a server that asked CUDA anything before forking would leave its
  # children a CUDA they cannot use.
  export HETERO_TESTS_ONE_RANK=nccl HETERO_TEST_START=spawn
  PHASE=tests
fi
if [ "$PHASE" = tests ]; then
  # SIGINT at the limit: pytest stops and still prints its summary; each failure's traceback is written as it comes.
  HETERO_FAILURES="$OUT/failures.txt" timeout -s INT -k 20 "${TESTS_TIMEOUT:-500}" \
    python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 150 --tb=short -rfE ${TESTS:-tests} >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >>"$OUT/pytest.log"
  # The failed tests at the log's end (the machine returns 8 files at most: no file of their own).
  { echo "---- failed"; grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | sort -u; } >>"$OUT/pytest.log"
fi
if [ "$PHASE" = smoke ] || [ "$PHASE" = all ]; then
  build_deepspeed
  timeout 230 python3 benchmarks/gpu_race.py --layers 2 --hidden 512 --heads 8 --intermediate 1376 --vocab 8000 \
    --seq 512 --batch 4 --steps 2 --warmup 1 --nvme-steps 1 --nvme-warmup 1 --nvme-dir "$NV" --timeout 120 \
    >"$OUT/smoke.txt" 2>&1
  echo "smoke exit $?" >>"$OUT/smoke.txt"
fi
if [ "$PHASE" = race ] || [ "$PHASE" = all ]; then
  if [ -n "${DS_PREBUILD:-}" ]; then
    build_deepspeed
  fi
  # PROFILE_DIR=/tmp/prof: every configuration profiled; the tables come back in one archive (the machine returns 8
  # files at most), with hetero_offload's trace beside it.
  timeout "${RACE_TIMEOUT:-400}" python3 benchmarks/gpu_race.py --nvme-dir "$NV" --timeout 150 --json \
    ${PROFILE_DIR:+--profile "$PROFILE_DIR"} ${RACE_ARGS:-} >"$OUT/race.json" 2>"$OUT/race.err"
  echo "race exit $?" >>"$OUT/race.err"
  if [ -n "${PROFILE_DIR:-}" ] && [ -d "$PROFILE_DIR" ]; then
    tar czf "$OUT/profile.tgz" -C "$PROFILE_DIR" --exclude='*_trace.json.gz' .
    cp "$PROFILE_DIR/hetero_offload_trace.json.gz" "$OUT/" 2>/dev/null || true
  fi
fi
if [ "$PHASE" = build ]; then
  build_deepspeed
fi
if [ "$PHASE" = waits ]; then
  timeout "${WAITS_TIMEOUT:-200}" python3 tools/gpu_waits.py --nvme-dir "$NV" --json >"$OUT/waits.json" 2>"$OUT/waits.err"
  echo "waits exit $?" >>"$OUT/waits.err"
  # fp16 where every chunk steps on the device: the overflow flag read once the update is queued ([Note: the
  # overflow check on the device]); its event may be counted, the read back before the update must not be.
  timeout "${WAITS_TIMEOUT:-200}" python3 tools/gpu_waits.py --precision fp16 --only device,device_clip,stage0,stage2 \
    --json >>"$OUT/waits.json" 2>>"$OUT/waits.err"
  echo "waits fp16 exit $?" >>"$OUT/waits.err"
fi
if [ "$PHASE" = nvme ]; then
  # The raw-disk reference is fio from huge-page buffers (benchmarks/README.md, "Disks get huge-page buffers").
  for size in ${NVME_SIZES:-1GiB 4GiB}; do
    PATH=$PWD/.tools:$PATH timeout "${NVME_TIMEOUT:-150}" python3 benchmarks/nvme_bandwidth.py --dir "$NV" \
      --size $size --repeat 3 --json >"$OUT/nvme_$size.json" 2>"$OUT/nvme_$size.err"
  done
fi
