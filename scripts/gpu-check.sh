#!/usr/bin/env bash
# The GPU proof (docs/gpu-check.md): does a decoder's release give back the
# memory a killed prefill left mapped into it?
#
#   bash scripts/gpu-check.sh --memory vram|dram [--out DIR] [--bundle DIR]
#        [--size BYTES] [--device N] [--runs "y ykeep n control live cost"]
#        (default: all of them for vram, all but cost for dram)
#
# On one machine (one GPU for vram), per run: a prefill registers a large
# region (--size; vram: most of the GPU) and a decode (`decode --memory ..`)
# loads its metadata and reads from it (every byte checked; over UCX's
# cuda_ipc for vram); the prefill is SIGKILLed; the figures of each phase
# are recorded: baseline, prefill_up, reading (before the kill), after_kill,
# after_release, replacement (a new prefill asking for the same budget: does
# it fit?). Runs: `y` (UCX_CUDA_IPC_CACHE=y, UCX's default, with the
# service's GPU-mapping ledger giving UCX's cached mappings back at the
# release), `ykeep` (cache y, the ledger off: NIXL_KEEPALIVE_GPU_UNMAP=off),
# `n` (cache n), and `control`: the decode never releases (heartbeats off,
# NIXL_KEEPALIVE_INTERVAL=inf, endpoint events off,
# NIXL_KEEPALIVE_ENDPOINT_EVENTS=off, and no read or probe after the first
# round). Two more: `live`, a live prefill retired by the router
# (POST /v1/peer_gone) and read again after it registers again, same process
# and allocation (reads checked, no CUDA error); and `cost`, read latency
# (one read in flight) and throughput (8 in flight) at 64 KiB, 1 MiB and
# 16 MiB, unchecked reads, cache y with the ledger against cache n. vram figures: the GPU's used memory
# (nvidia-smi); dram figures: the decode's and the prefill's resident
# memory, the decode's mappings and descriptors of the prefill's shared
# memory segments, whether the replacement started.
#
# Everything runs from the bundle (scripts/gpu-bundle.sh; default
# target/gpu-bundle): its binary, with NIXL_PREFIX at its runtime. Output in
# DIR (default $OUT when set, else target/gpu-check): table.txt (the table,
# also printed), figures.tsv (run, phase, figure, value), and the phases'
# files and the processes' logs under detail/ (as detail.tar.gz when DIR is
# $OUT, whose files come back only 8 at most). Exit 0 when every run went
# through its phases (reads verified, releases where expected); the VRAM
# verdicts are printed, not judged.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

memory=""
out=""
bundle="${repo_root}/target/gpu-bundle"
size=""
device=0
runs=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --memory) memory="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --bundle) bundle="$2"; shift 2 ;;
        --size) size="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
case "${memory}" in
    vram|dram) ;;
    *) echo "gpu-check.sh: --memory vram|dram is required" >&2; exit 2 ;;
esac
out="${out:-${OUT:-${repo_root}/target/gpu-check}}"
# `cost` times cuda_ipc: VRAM only.
if [[ -z "${runs}" ]]; then
    if [[ "${memory}" == vram ]]; then runs="y ykeep n control live cost"; else runs="y ykeep n control live"; fi
fi
bin="${bundle}/bin/nixl-keepalive"
if [[ ! -x "${bin}" || ! -d "${bundle}/runtime" ]]; then
    echo "gpu-check.sh: no bundle at ${bundle}: build it with 'bash scripts/gpu-bundle.sh'" >&2
    exit 1
fi
export NIXL_PREFIX="${bundle}/runtime"
# Loopback only (UCX's network transports; cuda_ipc is not a network device).
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
# UCX's memory-type cache learns of device memory from its CUDA allocation
# hooks (libucm_cuda), which the bundle cannot load (it needs libcudart.so.12,
# docs/gpu-check.md); with the cache on, an address it has not seen is taken
# as host memory, and NIXL refuses the VRAM registration ("VRAM memory is
# detected as host by UCX", measured on the H200 on 2026-12-04). Off, UCX asks
# the CUDA driver about each address (cuda_copy's detection).
#
# And UCX 1.23's cuda_ipc turns its READ (get zcopy) off when the GPU has no
# NVLink ("cuda-ipc get zcopy disabled as no nvlinks detected": one PCIe
# H200); the READs then go over TCP with host staging and map nothing of
# the prefill's memory, which is what this check is about. On, the decode
# reads over cuda_ipc as on an NVLink machine (measured: "zero-copy
# cuda_ipc/cuda").
if [[ "${memory}" == vram ]]; then
    export UCX_MEMTYPE_CACHE="${UCX_MEMTYPE_CACHE:-n}"
    export UCX_CUDA_IPC_ENABLE_GET_ZCOPY="${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-y}"
fi
export RUST_LOG="${RUST_LOG:-info}"
# LD_LIBRARY_PATH is left as it is: the bundle's libraries find each other
# through RPATH $ORIGIN (gpu-bundle.sh checked them with it unset), and the
# NVIDIA driver's libcuda.so.1 may be found only through it.

mkdir -p "${out}"
pack=0
if [[ -n "${OUT:-}" && "$(cd "${out}" && pwd)" == "$(cd "${OUT}" && pwd)" ]]; then
    pack=1
    detail="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
else
    detail="${out}/detail"
    rm -rf "${detail}"
    mkdir -p "${detail}"
fi
figures="${out}/figures.tsv"
printf 'run\tphase\tfigure\tvalue\n' >"${figures}"

pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do
        kill -KILL "${p}" 2>/dev/null || true
    done
    if (( pack )); then
        tar -czf "${out}/detail.tar.gz" -C "${detail}" . 2>/dev/null || true
        rm -rf "${detail}"
    fi
}
trap cleanup EXIT

log() { echo "[gpu-check $(date -u +%H:%M:%S)] $*"; }
fail() { echo "gpu-check.sh: FAILED: $*" >&2; failed=1; }
failed=0
now_ms() { date +%s%3N; }

# --- preflight --------------------------------------------------------------
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm); $(nproc) cores"
    echo "bundle: ${bundle}"
    head -n 6 "${bundle}/MANIFEST.txt" 2>/dev/null || true
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    echo "ldd, libraries missing (none listed: none):"
    find "${bundle}" -type f \( -name '*.so*' -o -name nixl-keepalive \) -print0 |
        xargs -0 -n1 sh -c 'ldd "$0" 2>/dev/null | sed -n "s|^[[:space:]]*\([^ ]*\) => not found.*|  missing: $0: \1|p"' || true
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv 2>&1 || true
    else
        echo "nvidia-smi: not found"
    fi
} >"${detail}/preflight.txt" 2>&1
if [[ "${memory}" == vram ]]; then
    command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu-check.sh: --memory vram needs nvidia-smi" >&2; exit 1; }
    if grep -q '^  missing: ' "${detail}/preflight.txt"; then
        log "preflight: libraries missing (see detail/preflight.txt):"
        grep '^  missing: ' "${detail}/preflight.txt" || true
    fi
fi

gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "${device}" | tr -d ' '; }
gpu_total() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${device}" | tr -d ' '; }

if [[ -z "${size}" ]]; then
    if [[ "${memory}" == vram ]]; then
        # Most of the GPU, and more than half of it: a second copy (the
        # replacement) fits only if the first was given back.
        free_mib=$(( $(gpu_total) - $(gpu_used) ))
        size="$(( free_mib * 60 / 100 ))M"
    else
        size="64M"
    fi
fi
log "memory=${memory} size=${size} device=${device} runs=${runs} out=${out}"
# The runs the table has columns for (live and cost have tables of their own).
table_runs=""
for r in ${runs}; do
    case "${r}" in y|ykeep|n|control) table_runs="${table_runs:+${table_runs} }${r}" ;; esac
done

# --- helpers ----------------------------------------------------------------
# wait_for FILE REGEX SECONDS [PID]: the first matching line, or fail (also
# when PID exits first).
wait_for() {
    local file="$1" re="$2" secs="$3" pid="${4:-}" end=$(( $(date +%s) + $3 ))
    while (( $(date +%s) < end )); do
        if grep -m1 -E "${re}" "${file}" 2>/dev/null; then return 0; fi
        if [[ -n "${pid}" ]] && ! kill -0 "${pid}" 2>/dev/null; then
            grep -m1 -E "${re}" "${file}" 2>/dev/null && return 0
            return 1
        fi
        sleep 0.1
    done
    return 1
}

# metric PORT NAME: the value of one sample line of the decode's /metrics.
metric() {
    local body
    if command -v curl >/dev/null 2>&1; then
        body="$(curl -s --max-time 2 "http://127.0.0.1:$1/metrics" || true)"
    else
        body="$( (exec 3<>"/dev/tcp/127.0.0.1/$1" &&
            printf 'GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3 &&
            timeout 2 cat <&3) 2>/dev/null || true)"
    fi
    awk -v n="$2" '$1 == n { print $2; exit }' <<<"${body}"
}

# The decode's start-up line about GPU mappings (what its releases do with
# UCX's cached CUDA IPC mappings), without the log's prefix.
gpu_mappings_line() { grep -m1 -o 'GPU mappings: [^"]*' "$1" | head -c 160 || echo "(none)"; }

# post PORT PATH BODY: an HTTP POST to the decode's control endpoint.
post() {
    if command -v curl >/dev/null 2>&1; then
        curl -s --max-time 5 -X POST "http://127.0.0.1:$1$2" -d "$3" || true
    else
        ( (exec 3<>"/dev/tcp/127.0.0.1/$1" &&
            printf 'POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' "$2" "${#3}" "$3" >&3 &&
            timeout 5 cat <&3) 2>/dev/null || true)
    fi
}

record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"${figures}"; echo "$3=$4" >>"${detail}/$1.$2.txt"; }

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo gone; }

# The prefill's shared memory segments (while it is alive): the inodes of
# the /dev/shm files its descriptors hold, and the SysV segments it made.
prefill_segments() {
    local p="$1" f
    : >"${detail}/$2.prefill-shm-inodes"
    for f in /proc/"${p}"/fd/*; do
        case "$(readlink "${f}" 2>/dev/null)" in
            /dev/shm/*) stat -L -c %i "${f}" 2>/dev/null >>"${detail}/$2.prefill-shm-inodes" || true ;;
        esac
    done
    awk -v p="${p}" 'NR > 1 && $5 == p { print $2 }' /proc/sysvipc/shm 2>/dev/null >"${detail}/$2.prefill-sysv-ids" || true
}

# decode_maps_of_prefill DECODE_PID RUN: mappings in the decode of the
# prefill's segments (posix: by inode under /dev/shm; SysV: by shmid).
decode_maps_of_prefill() {
    awk -v posix="${detail}/$2.prefill-shm-inodes" -v sysv="${detail}/$2.prefill-sysv-ids" '
        BEGIN { while ((getline l < posix) > 0) P[l] = 1; while ((getline l < sysv) > 0) S[l] = 1 }
        $6 ~ /^\/dev\/shm\// && ($5 in P) { n++ }
        $6 ~ /^\/SYSV/ && ($5 in S) { n++ }
        END { print n + 0 }' "/proc/$1/maps" 2>/dev/null || echo gone
}

decode_fds_of_prefill() {
    local n=0 f ino
    for f in /proc/"$1"/fd/*; do
        case "$(readlink "${f}" 2>/dev/null)" in
            /dev/shm/*)
                ino="$(stat -L -c %i "${f}" 2>/dev/null || true)"
                grep -q -x -F "${ino}" "${detail}/$2.prefill-shm-inodes" 2>/dev/null && n=$((n + 1)) ;;
        esac
    done
    echo "${n}"
}

sysv_alive() {
    awk -v ids="${detail}/$1.prefill-sysv-ids" '
        BEGIN { while ((getline l < ids) > 0) I[l] = 1 }
        NR > 1 && ($2 in I) { n++; a += $7 } END { printf "%d(nattch %d)", n + 0, a + 0 }' /proc/sysvipc/shm 2>/dev/null || echo "n/a"
}

# measure RUN PHASE DECODE_PID PREFILL_PID
measure() {
    local run="$1" phase="$2" d="${3:-}" p="${4:-}"
    echo "t_ms=$(( $(now_ms) - run_start ))" >>"${detail}/${run}.${phase}.txt"
    if [[ "${memory}" == vram ]]; then
        record "${run}" "${phase}" gpu_used_mib "$(gpu_used)"
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null |
            sed 's/^/apps: /' >>"${detail}/${run}.${phase}.txt" || true
    else
        awk '/^Shmem:/ { print "system_shmem_kib=" $2 }' /proc/meminfo >>"${detail}/${run}.${phase}.txt"
        [[ -n "${d}" ]] && record "${run}" "${phase}" decode_rss_kib "$(rss_kib "${d}")"
        [[ -n "${p}" ]] && record "${run}" "${phase}" prefill_rss_kib "$(rss_kib "${p}")"
        if [[ -n "${d}" && -f "${detail}/${run}.prefill-shm-inodes" ]]; then
            record "${run}" "${phase}" decode_maps_of_prefill_shm "$(decode_maps_of_prefill "${d}" "${run}")"
            record "${run}" "${phase}" decode_fds_of_prefill_shm "$(decode_fds_of_prefill "${d}" "${run}")"
            record "${run}" "${phase}" prefill_sysv_segments "$(sysv_alive "${run}")"
        fi
    fi
}

start_prefill() { # LOG -> sets started_pid, started_addr, started_ok
    local logf="$1"
    "${bin}" prefill --listen 127.0.0.1:0 --memory "${memory}" --cuda-device "${device}" \
        --size "${size}" --blocks 16 --block-size 65536 >"${logf}" 2>&1 &
    started_pid=$!
    pids+=("${started_pid}")
    local ready
    if ready="$(wait_for "${logf}" '^PREFILL READY' 120 "${started_pid}")"; then
        started_ok=1
        started_addr="$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"${ready}")"
    else
        started_ok=0
        started_addr=""
    fi
}

stop() { # PID SIGNAL SECONDS
    local p="$1" i
    kill "-$2" "${p}" 2>/dev/null || return 0
    for ((i = 0; i < $3 * 10; i++)); do
        kill -0 "${p}" 2>/dev/null || { wait "${p}" 2>/dev/null || true; return 0; }
        sleep 0.1
    done
    kill -KILL "${p}" 2>/dev/null || true
    wait "${p}" 2>/dev/null || true
}

# --- one run ----------------------------------------------------------------
run_one() {
    local run="$1" cache=y hb=2s events=on unmap=on
    case "${run}" in
        y) cache=y ;;
        ykeep) cache=y; unmap=off ;;
        n) cache=n ;;
        control) cache=y; hb=inf; events=off ;;
        *) echo "gpu-check.sh: unknown run ${run} (y, ykeep, n, control, live, cost)" >&2; exit 2 ;;
    esac
    run_start="$(now_ms)"
    log "run ${run}: UCX_CUDA_IPC_CACHE=${cache} NIXL_KEEPALIVE_GPU_UNMAP=${unmap} NIXL_KEEPALIVE_INTERVAL=${hb} NIXL_KEEPALIVE_ENDPOINT_EVENTS=${events}"
    measure "${run}" baseline

    start_prefill "${detail}/${run}.prefill.log"
    local pp="${started_pid}"
    if (( ! started_ok )); then
        fail "run ${run}: the prefill did not start: $(tail -n 3 "${detail}/${run}.prefill.log")"
        return
    fi
    prefill_segments "${pp}" "${run}"
    measure "${run}" prefill_up "" "${pp}"

    local dlog="${detail}/${run}.decode.log"
    UCX_CUDA_IPC_CACHE="${cache}" NIXL_KEEPALIVE_INTERVAL="${hb}" \
        NIXL_KEEPALIVE_ENDPOINT_EVENTS="${events}" NIXL_KEEPALIVE_GPU_UNMAP="${unmap}" \
        UCX_PROTO_INFO=y \
        "${bin}" decode --prefill "${started_addr}" --memory "${memory}" --cuda-device "${device}" \
        --reads 2 --read-pause-ms 3600000 --probe-ms 3600000 \
        --metrics-addr 127.0.0.1:0 >"${dlog}" 2>&1 &
    local dp=$!
    pids+=("${dp}")
    local mline mport verified=0 corrupt=0 end
    if ! mline="$(wait_for "${dlog}" '^metrics on http://' 60 "${dp}")"; then
        fail "run ${run}: the decode did not start: $(tail -n 3 "${dlog}")"
        stop "${dp}" KILL 5
        stop "${pp}" KILL 5
        return
    fi
    mport="$(sed -n 's|.*127\.0\.0\.1:\([0-9]*\)/.*|\1|p' <<<"${mline}")"
    end=$(( $(date +%s) + 60 ))
    while (( $(date +%s) < end )); do
        verified="$(metric "${mport}" 'nixl_keepalive_pd_reads_total{outcome="verified"}')"
        verified="${verified:-0}"
        (( verified >= 2 )) && break
        kill -0 "${dp}" 2>/dev/null || break
        sleep 0.2
    done
    corrupt="$(metric "${mport}" 'nixl_keepalive_pd_reads_total{outcome="corrupt"}')"
    record "${run}" reading verified_reads "${verified}"
    record "${run}" reading corrupt_reads "${corrupt:-0}"
    (( verified >= 1 )) || fail "run ${run}: no verified read ($(grep -m3 -E 'ERROR|WARN|error' "${dlog}" || true))"
    [[ "${corrupt:-0}" == 0 ]] || fail "run ${run}: ${corrupt} corrupt reads"
    measure "${run}" reading "${dp}" "${pp}"
    record "${run}" reading gpu_mappings "$(gpu_mappings_line "${dlog}")"

    local t_kill
    t_kill="$(now_ms)"
    kill -KILL "${pp}"
    wait "${pp}" 2>/dev/null || true
    measure "${run}" after_kill "${dp}"
    if [[ "${memory}" == vram ]]; then
        # From the kill to the dead prefill's memory back (the GPU within
        # 1 GiB of this run's baseline), polled; at most 10 s.
        local base_mib back="not within 10 s" i
        base_mib="$(awk -F= '/^gpu_used_mib=/ { print $2; exit }' "${detail}/${run}.baseline.txt")"
        for ((i = 0; i < 200; i++)); do
            if (( $(gpu_used) <= base_mib + 1024 )); then
                back="$(( $(now_ms) - t_kill )) ms after the kill"
                break
            fi
            (( $(now_ms) - t_kill > 10000 )) && break
            sleep 0.05
        done
        record "${run}" after_release memory_back "${back}"
    fi
    local released_at_kill=no
    grep -q '^event: released' "${dlog}" && released_at_kill=yes
    record "${run}" after_kill released_yet "${released_at_kill}"

    if [[ "${run}" == control ]]; then
        sleep 5
        if grep -q '^event: released' "${dlog}"; then
            fail "run control: the decode released (it must not)"
            record "${run}" after_release released "yes(unexpected)"
        else
            record "${run}" after_release released "no (control, 5 s)"
        fi
    else
        if wait_for "${dlog}" '^event: released' 30 "${dp}" >/dev/null; then
            record "${run}" after_release released "yes, $(( $(now_ms) - t_kill )) ms after the kill"
        else
            fail "run ${run}: no release within 30 s of the kill"
            record "${run}" after_release released "no"
        fi
        sleep 1
    fi
    measure "${run}" after_release "${dp}"

    start_prefill "${detail}/${run}.replacement.log"
    local rp="${started_pid}"
    if (( started_ok )); then
        record "${run}" replacement fits yes
        measure "${run}" replacement "${dp}" "${rp}"
    else
        record "${run}" replacement fits "no: $(grep -m1 -o -E 'CUDA_ERROR_[A-Z_]+|error: .*' "${detail}/${run}.replacement.log" | head -c 120)"
        measure "${run}" replacement "${dp}"
        [[ "${memory}" == dram ]] && fail "run ${run}: the replacement prefill did not start"
    fi
    stop "${rp}" TERM 10
    stop "${dp}" TERM 20
    # UCX's own account (UCX_PROTO_INFO=y) of how the decode's READs go:
    # "into cuda from cuda" over cuda_ipc for vram, cma for dram. Read once
    # the decode has exited: UCX's stdio output is flushed by then.
    record "${run}" reading read_protocol "$(awk -F'|' '
        /remote memory read by ucp_get/ { what = $2; sub(/.*into /, "into ", what); sub(/ +$/, "", what); want = 8; next }
        want > 0 { want--; if ($2 ~ /\.\./) { gsub(/^ +| +$/, "", $3); gsub(/^ +| +$/, "", $4); print what ": " $3 " " $4 } }' "${dlog}" |
        sort -u | paste -s -d ';' -)"
    if [[ "${memory}" == vram ]]; then
        # Wait for the GPU to be back where it was before the next run.
        local base i
        base="$(awk -F= '/^gpu_used_mib=/ { print $2; exit }' "${detail}/${run}.baseline.txt")"
        for ((i = 0; i < 100; i++)); do
            (( $(gpu_used) <= base + 1024 )) && break
            sleep 0.3
        done
    fi
    log "run ${run}: done in $(( $(now_ms) - run_start )) ms"
}

# --- the live peer: retired by the router, read again -----------------------
# A live prefill (never killed) is retired through the decode's control
# endpoint (POST /v1/peer_gone): the service releases it, the ledger gives
# UCX's cached mapping of its memory back; the decode's reader handshakes
# again with the same process, which registers the same allocation (same
# pid, base address and buffer id: UCX's cache would have hit a stale
# entry), and reads again. Every read is checked; any CUDA error fails.
run_live() {
    local run=live
    run_start="$(now_ms)"
    log "run live: UCX_CUDA_IPC_CACHE=y NIXL_KEEPALIVE_GPU_UNMAP=on, a live prefill retired and read again"
    measure "${run}" baseline
    start_prefill "${detail}/${run}.prefill.log"
    local pp="${started_pid}" addr="${started_addr}"
    if (( ! started_ok )); then
        fail "run live: the prefill did not start: $(tail -n 3 "${detail}/${run}.prefill.log")"
        return
    fi
    local dlog="${detail}/${run}.decode.log"
    UCX_CUDA_IPC_CACHE=y NIXL_KEEPALIVE_INTERVAL=2s NIXL_KEEPALIVE_GPU_UNMAP=on \
        "${bin}" decode --prefill "${addr}" --memory "${memory}" --cuda-device "${device}" \
        --reads 2 --read-pause-ms 200 --probe-ms 3600000 \
        --control-addr 127.0.0.1:0 >"${dlog}" 2>&1 &
    local dp=$!
    pids+=("${dp}")
    local cline cport before after verified=0 end
    if ! cline="$(wait_for "${dlog}" '^control on http://' 60 "${dp}")"; then
        fail "run live: the decode did not start: $(tail -n 3 "${dlog}")"
        stop "${dp}" KILL 5; stop "${pp}" KILL 5
        return
    fi
    cport="$(sed -n 's|.*127\.0\.0\.1:\([0-9]*\)/.*|\1|p' <<<"${cline}")"
    end=$(( $(date +%s) + 60 ))
    while (( $(date +%s) < end )); do
        verified="$(metric "${cport}" 'nixl_keepalive_pd_reads_total{outcome="verified"}')"
        (( ${verified:-0} >= 2 )) && break
        kill -0 "${dp}" 2>/dev/null || break
        sleep 0.2
    done
    record "${run}" reading verified_reads "${verified:-0}"
    record "${run}" reading gpu_mappings "$(gpu_mappings_line "${dlog}")"
    measure "${run}" reading "${dp}" "${pp}"
    (( ${verified:-0} >= 2 )) || { fail "run live: no verified reads before the retire"; stop "${dp}" KILL 5; stop "${pp}" KILL 5; return; }
    record "${run}" retire answer "$(post "${cport}" /v1/peer_gone "{\"address\": \"${addr}\", \"mode\": \"drain\"}" | tail -n 1 | head -c 120)"
    if wait_for "${dlog}" '^event: released' 30 "${dp}" >/dev/null; then
        record "${run}" retire released yes
    else
        fail "run live: no release within 30 s of the retire"
        record "${run}" retire released no
    fi
    before="$(metric "${cport}" 'nixl_keepalive_pd_reads_total{outcome="verified"}')"
    local unmapped unmapped_bytes
    unmapped="$(metric "${cport}" 'nixl_keepalive_release_gpu_mappings_total{outcome="unmapped"}')"
    unmapped_bytes="$(metric "${cport}" 'nixl_keepalive_release_gpu_unmapped_bytes_total')"
    record "${run}" retire gpu_mappings_unmapped "${unmapped:-0}"
    record "${run}" retire gpu_unmapped_bytes "${unmapped_bytes:-0}"
    measure "${run}" retire "${dp}" "${pp}"
    # Registered again (the reader handshakes for whoever is at the address)
    # and read again: at least 4 more verified reads.
    end=$(( $(date +%s) + 30 ))
    after="${before:-0}"
    while (( $(date +%s) < end )); do
        after="$(metric "${cport}" 'nixl_keepalive_pd_reads_total{outcome="verified"}')"
        (( ${after:-0} >= ${before:-0} + 4 )) && break
        kill -0 "${dp}" 2>/dev/null || break
        sleep 0.2
    done
    record "${run}" read_again verified_after_retire "$(( ${after:-0} - ${before:-0} ))"
    local corrupt failed_reads
    corrupt="$(metric "${cport}" 'nixl_keepalive_pd_reads_total{outcome="corrupt"}')"
    failed_reads="$(metric "${cport}" 'nixl_keepalive_pd_reads_total{outcome="failed"}')"
    record "${run}" read_again corrupt_reads "${corrupt:-0}"
    record "${run}" read_again failed_reads "${failed_reads:-0}"
    local cuda_errors
    cuda_errors="$(grep -c -E 'CUDA_ERROR|illegal memory|cuda.*failed' "${dlog}" || true)"
    record "${run}" read_again cuda_error_lines "${cuda_errors}"
    record "${run}" read_again decode_alive "$(kill -0 "${dp}" 2>/dev/null && echo yes || echo no)"
    (( ${after:-0} >= ${before:-0} + 4 )) || fail "run live: not read again after the retire"
    [[ "${corrupt:-0}" == 0 ]] || fail "run live: ${corrupt} corrupt reads"
    [[ "${cuda_errors}" == 0 ]] || fail "run live: CUDA errors in the decode's log"
    measure "${run}" read_again "${dp}" "${pp}"
    stop "${dp}" TERM 20
    stop "${pp}" TERM 10
    log "run live: done in $(( $(now_ms) - run_start )) ms"
}

# --- the cost: reads with UCX's cache on (and the ledger) against off --------
# Unchecked reads (decode --no-check: checking copies a VRAM slot back to the
# host), back to back (--read-pause-ms 0), counted over COST_SECONDS from the
# decode's /metrics: one read in flight gives the latency (the run's time over
# its reads, the harness's own turn included, the same in both columns); 8 in
# flight the throughput.
cost_secs="${COST_SECONDS:-3}"
cost_rate() { # PORT -> reads completed in cost_secs, and the ms it took
    local c0 c1 t0 t1 end
    end=$(( $(date +%s) + 60 ))
    while (( $(date +%s) < end )); do
        c0="$(metric "$1" 'nixl_keepalive_pd_reads_total{outcome="unchecked"}')"
        (( ${c0:-0} >= 2 )) && break
        sleep 0.2
    done
    t0="$(now_ms)"
    c0="$(metric "$1" 'nixl_keepalive_pd_reads_total{outcome="unchecked"}')"
    sleep "${cost_secs}"
    c1="$(metric "$1" 'nixl_keepalive_pd_reads_total{outcome="unchecked"}')"
    t1="$(now_ms)"
    echo "$(( ${c1:-0} - ${c0:-0} )) $(( t1 - t0 ))"
}
run_cost() {
    local run=cost sz bytes cache inflight dp dlog mline mport n ms pp
    run_start="$(now_ms)"
    log "run cost: read latency and throughput, cache y (with the ledger) against cache n"
    for sz in 64K 1M 16M; do
        case "${sz}" in 64K) bytes=65536 ;; 1M) bytes=1048576 ;; 16M) bytes=16777216 ;; esac
        "${bin}" prefill --listen 127.0.0.1:0 --memory "${memory}" --cuda-device "${device}" \
            --size 1G --blocks 16 --block-size "${bytes}" >"${detail}/cost.${sz}.prefill.log" 2>&1 &
        pp=$!
        pids+=("${pp}")
        local ready addr
        if ! ready="$(wait_for "${detail}/cost.${sz}.prefill.log" '^PREFILL READY' 120 "${pp}")"; then
            fail "run cost: the ${sz} prefill did not start"
            continue
        fi
        addr="$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"${ready}")"
        for cache in y n; do
            for inflight in 1 8; do
                dlog="${detail}/cost.${sz}.${cache}.${inflight}.decode.log"
                UCX_CUDA_IPC_CACHE="${cache}" NIXL_KEEPALIVE_GPU_UNMAP=on UCX_PROTO_INFO=y \
                    "${bin}" decode --prefill "${addr}" --memory "${memory}" --cuda-device "${device}" \
                    --reads "${inflight}" --read-pause-ms 0 --probe-ms 3600000 --no-check \
                    --metrics-addr 127.0.0.1:0 >"${dlog}" 2>&1 &
                dp=$!
                pids+=("${dp}")
                if ! mline="$(wait_for "${dlog}" '^metrics on http://' 60 "${dp}")"; then
                    fail "run cost: the decode did not start (${sz}, cache ${cache})"
                    stop "${dp}" KILL 5
                    continue
                fi
                mport="$(sed -n 's|.*127\.0\.0\.1:\([0-9]*\)/.*|\1|p' <<<"${mline}")"
                read -r n ms < <(cost_rate "${mport}")
                if (( inflight == 1 )); then
                    record cost "${sz}" "latency_us_cache_${cache}" "$(( n > 0 ? ms * 1000 / n : -1 ))"
                else
                    record cost "${sz}" "throughput_mib_s_cache_${cache}" "$(( ms > 0 ? n * bytes / 1048576 * 1000 / ms : -1 ))"
                fi
                record cost "${sz}" "reads_${cache}_${inflight}" "${n} in ${ms} ms"
                stop "${dp}" TERM 20
            done
        done
        stop "${pp}" TERM 10
    done
    log "run cost: done in $(( $(now_ms) - run_start )) ms"
}

for r in ${runs}; do
    case "${r}" in
        live) run_live ;;
        cost) run_cost ;;
        *) run_one "${r}" ;;
    esac
done

# --- the table ---------------------------------------------------------------
table="${out}/table.txt"
{
    echo "GPU check, --memory ${memory}, size ${size} per prefill, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -n)"
    awk -F'\t' -v runs="${table_runs}" '
        NR == 1 { next }
        $1 == "live" || $1 == "cost" { next }
        { key = $2 " | " $3; if (!(key in seen)) { seen[key] = 1; order[++n] = key } v[key, $1] = $4 }
        END {
            nr = split(runs, R, " ")
            head = "| phase | figure |"; sep = "|---|---|"
            for (i = 1; i <= nr; i++) {
                name = R[i] == "control" ? "control (no release)" : R[i] == "y" ? "cache y + unmapping" : R[i] == "ykeep" ? "cache y (ledger off)" : "cache " R[i]
                head = head " " name " |"; sep = sep "---|"
            }
            print head; print sep
            for (k = 1; k <= n; k++) {
                line = "| " order[k] " |"
                for (i = 1; i <= nr; i++) { x = v[order[k], R[i]]; line = line " " (x == "" ? "-" : x) " |" }
                print line
            }
        }' "${figures}"
    for r in live cost; do
        grep -q -P "^${r}\t" "${figures}" || continue
        echo
        echo "| ${r}: phase | figure | value |"
        echo "|---|---|---|"
        awk -F'\t' -v r="${r}" '$1 == r { print "| " $2 " | " $3 " | " $4 " |" }' "${figures}"
    done
    if [[ "${memory}" == vram ]]; then
        for r in ${table_runs}; do
            awk -F'\t' -v r="${r}" '
                $1 == r && $3 == "gpu_used_mib" { u[$2] = $4 }
                $1 == r && $3 == "fits" { fit = $4 }
                END {
                    if (!("after_kill" in u)) exit
                    printf "VERDICT %s: after the kill %d MiB used, after the release %d MiB (%+d MiB), replacement fits: %s\n",
                        r, u["after_kill"], u["after_release"], u["after_release"] - u["after_kill"], fit
                }' "${figures}"
        done
    fi
} >"${table}"
cat "${table}"
if (( failed )); then
    echo "gpu-check.sh: FAILED (see above and ${out})" >&2
    exit 1
fi
echo "gpu-check.sh: PASSED (${memory}): every run went through its phases"
