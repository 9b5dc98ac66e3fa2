#!/usr/bin/env bash
# Reintroduce one defect at a time in a scratch worktree of this checkout's HEAD, run the tests that should catch it,
# print the first failures, and restore: the suite must still catch each one. Usage: bash tests/defect_check.sh
set -u
SRC="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
W="$(mktemp -d)/tree"
git -C "$SRC" worktree add -q --detach "$W" HEAD
mkdir -p "$W/bsr_kernels/lib"; cp "$SRC"/bsr_kernels/lib/*.so "$W/bsr_kernels/lib/"
cd "$W"
PY="${BSR_PYTHON:-$SRC/.venv/bin/python}"
defect() {  # name, file, python-replace-old, new, test paths...
  local name=$1 file=$2 old=$3 new=$4; shift 4
  $PY - "$file" "$old" "$new" <<'P'
import sys; p, old, new = sys.argv[1:]; s = open(p).read(); assert s.count(old) == 1, (p, old); open(p, "w").write(s.replace(old, new))
P
  echo "=== $name: $(git diff --stat | tail -1)"; git diff | grep '^[-+][^-+]'
  local out summary
  out=$(TRITON_INTERPRET=1 timeout 1500 $PY -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@" 2>&1)
  summary=$(grep -E "^FAILED|[0-9]+ passed|[0-9]+ failed" <<<"$out" | head -12)
  echo "$summary"
  grep -E "^E  " <<<"$out" | cut -c1-240 | head -6  # what the failing tests printed first
  grep -qE "[0-9]+ failed" <<<"$summary" || { echo "NOT CAUGHT: $name"; status=1; }
  git checkout -q -- .
}
status=0
defect "restore: a rank whose group failed still commits" bsr_runtime/retrieve.py \
  "self.committed = self.agreed and all(self.valid_per_group)" "self.committed = self.agreed" \
  tests/unit/test_fail_closed.py tests/unit/test_fail_closed_property.py tests/unit/test_restore.py tests/unit/test_restore_tiers.py tests/unit/test_bad_input.py
defect "tiers: the filesystem tier accepts a checksum mismatch" bsr_runtime/tiers/filesystem.py \
  "if crc_at(algo, addr, self.chunk_bytes) != crc:" "if False and crc_at(algo, addr, self.chunk_bytes) != crc:" \
  tests/unit/test_fs_tier.py tests/unit/test_tier_contract.py tests/unit/test_fail_closed.py
defect "connector: a failed background load is reported as received" bsr_runtime/integrations/vllm/worker.py \
  "                failed.add(record.request_id)" "                pass" \
  tests/integration/vllm/test_vllm_engine.py tests/integration/vllm/test_vllm_repair.py
# issue 36: BSR's LMCache server module
defect "LMCache server module: a failed retrieve reports success (a rank's poisoned blocks served)" \
  bsr_runtime/integrations/lmcache/server_retrieve.py \
  "            self._failed(key, cause, source.peak_objects)
            return False" "            self._failed(key, cause, source.peak_objects)
            return True" \
  tests/integration/vllm/test_lmcache_server_tp.py tests/integration/vllm/test_lmcache_server_module.py
defect "LMCache server module: a window's prefetched objects not counted as held (depth 2 reports W)" \
  bsr_runtime/integrations/lmcache/server_retrieve.py \
  "                staged.hold(len(keys))" "                pass" \
  tests/integration/vllm/test_lmcache_server_tp.py
# a save's put reads its staging only after the gather landed (GPU gathers return before they complete)
defect "saver: the put reads its staging before the gather landed" bsr_runtime/saver.py \
  "                job.lease.synchronize()  # the gather landed: the puts read what it wrote" "                job.lease.synchronized = True" \
  tests/unit/test_saver.py tests/unit/test_window_loop.py
# the loop's failure block (a plain context manager since d22238b): a failed window gives back what it holds
defect "window loop: a failed window's fetched staging is not abandoned" bsr_runtime/window_loop.py \
  "            held.abandon(self._loop.stream)" "            pass" \
  tests/unit/test_window_loop.py
# issue 40: the step waits for a background lookup once (probe_wait_s)
defect "planner: probe_wait_s ignored" bsr_runtime/planner.py \
  "if not running.waited_in_step and self.probe_wait_s > 0:" "if False:" \
  tests/unit/test_planner.py
# issue 40: background loads start in handle_preemptions; a resident prompt starts no lookup
defect "connector: background loads wait for start_load_kv (handle_preemptions starts nothing)" \
  bsr_runtime/integrations/vllm/connector.py \
  "        if self.worker is not None and self.worker.load_async and isinstance(" "        if False and isinstance(" \
  tests/integration/vllm/test_vllm_engine.py
defect "connector: a prompt resident in vLLM's cache still starts a lookup at its arrival" \
  bsr_runtime/integrations/vllm/scheduler.py \
  "self.load_async and not self._cached_by_vllm(request) and" "self.load_async and" \
  tests/integration/vllm/test_vllm_engine.py
defect "keys: a bool id packed as 0 accepted" bsr_runtime/validation.py \
  "        if isinstance(tokens[i], bool):" "        if False:" \
  tests/unit/test_validation.py
# issue 39: a Mooncake cluster shared by engines (one module: its processes start once)
defect "cluster: engines mount a segment of their own (objects not on the store hosts)" bsr_runtime/tiers/registry.py \
  'engine_defaults={"global_segment_size": 0}' 'engine_defaults={"global_segment_size": 64 << 20}' \
  tests/integration/vllm/test_mooncake_cluster.py
defect "cluster: replica_num ignored (one copy per object)" bsr_runtime/tiers/mooncake_hosts.py \
  "config.replica_num = replica_num" "config.replica_num = 1" \
  tests/integration/vllm/test_mooncake_cluster.py
defect "cluster: the repair save after a failed load skipped" bsr_runtime/save_triggers.py \
  "t.saved_chunks, t.overwrite, t.partial_saved = 0, True, False" "pass" \
  tests/integration/vllm/test_mooncake_cluster.py
defect "cluster: a lost store host's transfer failure not told apart (no failover, cause other)" bsr_runtime/tiers/mooncake.py \
  "if code == TRANSFER_FAIL:" "if False:" \
  tests/integration/vllm/test_mooncake_cluster.py
defect "cluster: unavailable_cooldown_s not passed to the planner (a restarted master skipped 30 s)" bsr_runtime/integrations/vllm/scheduler.py \
  "                               unavailable_cooldown_s=cfg.tuning.unavailable_cooldown_s)" "                               )" \
  tests/integration/vllm/test_mooncake_cluster.py
defect "cluster: a put placed on a lost store host not put again on a live one" bsr_runtime/tiers/mooncake_hosts.py \
  "PUT_RETRIES = 3" "PUT_RETRIES = 0" \
  tests/integration/vllm/test_mooncake_cluster.py
# issue 41: a window's reads are one job of the filesystem tier's native reader
defect "fs reader: objects read after their job's deadline passed" csrc/bsr_fs_read.c \
  "if (now_ns() > j->deadline_ns) {" "if (0) {" \
  tests/unit/test_fs_native.py
defect "fs tier: a native read's body checksum not compared" bsr_runtime/tiers/fs_fetch.py \
  "                if got != crc:" "                if False:" \
  tests/unit/test_fs_native.py tests/unit/test_fs_tier.py
defect "fs reader: a job freed while another caller waits on it" csrc/bsr_fs_read.c \
  "        if (j->waiters > 0)
            j->forgotten = 1; /* unknown from now on; freed by its last waiter */
        else
            free_job(r, j);" "        free_job(r, j);" \
  tests/unit/test_fs_native.py
defect "records: the performance page keeps one record per configuration (one machine's figures hide the other's)" \
  bsr_harness/records.py \
  'key = json.dumps([rec.get("settings", {}), machine_kind(rec)], sort_keys=True)' \
  'key = json.dumps(rec.get("settings", {}), sort_keys=True)' \
  tests/unit/test_records.py
defect "tiers: Mooncake over tcp and LMCache restore at depth 1 whatever the window (large windows lose the overlap)" \
  bsr_runtime/tiers/base.py \
  "return 2 if window_bytes // 2 >= DEPTH2_HALF_WINDOW_BYTES else 1" "return 1" \
  tests/unit/test_tier_contract.py tests/integration/lmcache/test_lmcache_tier.py
defect "gpu_check: the copy-engine baselines' runs miss a block (the baseline moves other bytes)" \
  benchmarks/gpu_check.py \
  "            if b < 0:" "            if b < 0 or k == 1:" \
  tests/unit/test_gpu_check_runs.py
# issue 41: the CPU library's pool shares a window's items; the caller never waits for a worker that has not started
defect "CPU pool: a worker not started yet is waited for (not withdrawn)" csrc/bsr_cpu_pool.c \
  "            if (g_assigned[i]) {" "            if (0 && g_assigned[i]) {" \
  tests/unit/test_cpu_backend.py
defect "CPU install: items after a failure still run and the last failing one's error is reported" csrc/bsr_install_cpu.c \
  "        for (int64_t k = begin; k < end && k < __atomic_load_n(&sw->failed_item, __ATOMIC_RELAXED); ++k) {
            const int rc = copy_segment(w, k / w->num_tensors, k % w->num_tensors);
            if (rc == BSR_OK) continue;
            pthread_mutex_lock(&sw->mu);
            if (k < sw->failed_item) {" "        for (int64_t k = begin; k < end; ++k) {
            const int rc = copy_segment(w, k / w->num_tensors, k % w->num_tensors);
            if (rc == BSR_OK) continue;
            pthread_mutex_lock(&sw->mu);
            if (1) {" \
  tests/unit/test_cpu_backend.py
git -C "$SRC" worktree remove --force "$W"
exit $status
