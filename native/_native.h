/*
 * Shared declarations of the shmdisagg._native translation units (native/README.md has the map):
 * the control-segment layout constants (single source of truth), the atomics, the seqlock
 * helpers, the `Region` type and the helpers that index.c reuses from _native.c.
 */
#ifndef SHMDISAGG_NATIVE_H
#define SHMDISAGG_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

_Static_assert(__atomic_always_lock_free(8, 0), "8-byte atomics must be lock-free (address-free)");
_Static_assert(__atomic_always_lock_free(4, 0), "4-byte atomics must be lock-free (address-free)");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the layout is little-endian");

/* ---- control layout (version 3): keep in step with native/README.md -------------------- */

#define MAGIC 0x31564C5447534453ULL /* "SDSGTLV1" little-endian */
#define LAYOUT_VERSION 4u /* 2: index publication, index metrics; 3: log-linear lag histogram;
                              4: a row records its fleet index (W_FLEET) */
#define HEADER_BYTES 4096u
#define MAX_SERVERS 64u
#define MAX_ROLES 2u
#define SERVER_STRIDE 256u
#define WORKER_STRIDE 2048u
#define MAX_WORKERS_LIMIT 4096u
#define OFF_SERVERS 0x1000u
#define OFF_WORKERS (OFF_SERVERS + MAX_SERVERS * SERVER_STRIDE) /* 0x5000 */
#define SEQ_TRIES 512

/* header words */
#define H_MAGIC 0x000u
#define H_VERSION 0x008u  /* u32 layout_version | u32 header_bytes << 32 */
#define H_SEGBYTES 0x010u /* u64 logical segment size */
#define H_COUNTS 0x018u   /* u16 max_servers | u16 max_workers << 16 | u32 flags << 32 */
#define H_SERVERS 0x020u  /* u32 off_servers | u32 server_stride << 32 */
#define H_WORKERS 0x028u  /* u32 off_workers | u32 worker_stride << 32 */
#define H_CREATED 0x030u
#define H_INIT 0x038u
#define INIT_READY 1u

/* coordinator line */
#define OFF_COORD 0x080u
#define C_PID 0x080u
#define C_START 0x088u
#define C_INC 0x090u
#define C_HEARTBEAT 0x098u
#define C_STATE 0x0A0u

/* config block (seqlock) */
#define OFF_CONFIG 0x100u
#define CFG_SEQ 0x100u
#define CFG_PRESENT 0x108u
#define CFG_HEALTHY 0x110u
#define CFG_ROLE0 0x118u /* role_mask[0] context; role_mask[1] generation at +8 */
#define CFG_VERSION 0x128u
enum { K_PRESENT, K_HEALTHY, K_ROLE0, K_ROLE1, K_VERSION, CFG_WORDS };

/* worker-written shared lines */
#define OFF_RR 0x180u /* rr[role] at OFF_RR + role * 128 */
#define RR_STRIDE 128u
#define OFF_ROWS_LINE 0x280u
#define RL_HWM 0x280u      /* 1 + highest row index ever claimed (CAS-max by claimers) */
#define RL_CLAIM_SEQ 0x288u /* claim counter, low 32 bits of every token */

/* coordinator-written totals of reclaimed rows */
#define OFF_RETIRED 0x300u /* retired_routed[64] */
#define RET_COMPLETED 0x500u
#define RET_DISPATCHED 0x508u

/* index publication (seqlock, coordinator): the generation workers must map (0: none yet) */
#define OFF_IDXPUB 0x580u
#define IP_SEQ 0x580u
#define IP_GEN 0x588u   /* also read alone (acquire) by every worker pick: one load */
#define IP_CAP 0x590u   /* slots */
#define IP_BYTES 0x598u /* logical segment size */
#define IP_NAME 0x5A0u  /* POSIX name, NUL-padded, 8 relaxed u64 stores */
#define IP_NAME_BYTES 64u

/* index metrics written by the coordinator (relaxed words; readers derive rates) */
#define OFF_IDXMET 0x600u
enum {
    IM_EVENTS,    /* apply_stored / apply_removed calls */
    IM_BLOCKS,    /* block hashes applied by them */
    IM_STORED,    /* of which stored */
    IM_REMOVED,   /* of which removed */
    IM_CLEARED,   /* apply_all_cleared + clear_server calls */
    IM_DROPPED,   /* events the ingest dropped (unknown server, malformed): count_dropped() */
    IM_LIVE,      /* keys with a mask bit set, at the last sweep */
    IM_DEAD,      /* keys with both masks 0, at the last sweep */
    IM_USED,      /* slots holding a key, at the last sweep */
    IM_MAXPROBE,  /* longest probe of the current generation, at the last sweep */
    IM_SESSIONS,  /* explicit conversation sessions, at the last sweep */
    IM_IMPLICIT,  /* implicit-conversation prefix entries, at the last sweep */
    IM_SWEEPS,
    IM_EXPIRED,   /* routed masks cleared by the TTL */
    IM_EVICTED,   /* sessions and implicit entries evicted by recency (LRU) */
    IM_RESIZES,   /* generations built after the first */
    IM_LAST_SWEEP_NS,
    IM_LAG_SAMPLES,
    IM_LAG_SUM_NS,
    IM_WORDS
};
#define IM_WORD(i) (OFF_IDXMET + 8u * (unsigned)(i))
/* counters any process adds to (fetch_add), on their own line */
#define OFF_IDXCNT 0x700u
#define IC_FULL_DROPS 0x700u  /* inserts refused because the index was full */
#define IC_RACE_RERUNS 0x708u /* kv picks re-scored after losing a claim race */
/* event-to-visibility lag histogram (coordinator), log-linear in ns: a lag of 0..3 counts in
 * bucket 0..3; a larger one in 4 * msb + the two bits below its msb (4 sub-buckets per octave,
 * each a quarter of it wide; buckets 4..7 stay empty). Bucket 4m + s, m >= 2, covers
 * [(4 + s) << (m - 2), (5 + s) << (m - 2)) ns. */
#define OFF_LAGHIST 0x800u
#define LAG_BUCKETS 256u

/* server record (seqlock each) */
#define S_SEQ 0u
#define S_INC 8u
#define S_FLAGS 16u /* u32 flags | u32 weight << 32 */
#define S_HEALTH 24u
#define S_MAXBATCH 32u
#define S_TPB 40u
#define S_MAXTOK 48u
#define S_ADDR 64u
#define ADDR_BYTES 128u
#define FLAG_PRESENT 1u
#define FLAG_HEALTHY 2u
#define ROLE_SHIFT 8u

/* worker row */
#define W_TOKEN 0u
#define W_START 8u
#define W_HEARTBEAT 16u
#define W_IDXGEN 24u
#define W_COORDINC 32u
#define W_DISPATCHED 40u
#define W_COMPLETED 48u
#define W_PID 56u
#define W_FLEET 64u /* fleet index + 1 of the owner (0: not a fleet worker), for a restarted coordinator */
#define W_ACTIVE_REQ 128u /* i32[64] */
#define W_ACTIVE_TOK 384u /* i64[64] */
#define W_ROUTED 896u     /* u64[64] */
#define W_END 1408u
#define TOKEN_FREE 0ULL
#define TOKEN_RECLAIMING (~0ULL)

_Static_assert(OFF_WORKERS == 0x5000u, "worker rows start at 0x5000");
_Static_assert(C_STATE + 8 <= OFF_CONFIG && CFG_VERSION + 8 <= OFF_RR, "header lines overlap");
_Static_assert(OFF_RR + MAX_ROLES * RR_STRIDE <= OFF_ROWS_LINE, "rr tickets overlap");
_Static_assert(OFF_RETIRED + MAX_SERVERS * 8 == RET_COMPLETED, "retired totals overlap");
_Static_assert(RET_DISPATCHED + 8 <= OFF_IDXPUB, "retired totals overlap the index publication");
_Static_assert(IP_NAME + IP_NAME_BYTES <= OFF_IDXMET, "index publication overflows its line");
_Static_assert(IM_WORD(IM_WORDS) <= OFF_IDXCNT, "index metrics overflow");
_Static_assert(IC_RACE_RERUNS + 8 <= OFF_LAGHIST, "index counters overflow");
_Static_assert(OFF_LAGHIST + 8 * LAG_BUCKETS <= HEADER_BYTES, "header overflows 4096 bytes");
_Static_assert(S_ADDR + ADDR_BYTES <= SERVER_STRIDE, "server record overflows its stride");
_Static_assert(W_ACTIVE_TOK == W_ACTIVE_REQ + 4 * MAX_SERVERS, "row layout");
_Static_assert(W_ROUTED == W_ACTIVE_TOK + 8 * MAX_SERVERS, "row layout");
_Static_assert(W_END == W_ROUTED + 8 * MAX_SERVERS && W_END <= WORKER_STRIDE, "row overflows");
_Static_assert(SERVER_STRIDE % 128 == 0 && WORKER_STRIDE % 128 == 0, "records pad to 128 B");

/* ---- exceptions ------------------------------------------------------------------------- */

/* Symbols shared between the extension's translation units; hidden outside the .so. */
#define SD_HIDDEN __attribute__((visibility("hidden")))

SD_HIDDEN extern PyObject *ShmError, *LayoutMismatch, *RetryExhausted, *SegmentFull, *RowLost;

/* ---- atomics ---------------------------------------------------------------------------- */

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define LDA(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define STR(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Writer side (the single coordinator, guaranteed by flock). Returns the odd value to pass to
 * seq_write_end. A sequence left odd by a killed writer is moved on to the next odd value, so the
 * next write repairs it. */
static inline uint64_t seq_write_begin(uint64_t *seq)
{
    uint64_t odd = (LD(seq) + 1) | 1;
    ST(seq, odd);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* orders the odd store before the data stores */
    return odd;
}

static inline void seq_write_end(uint64_t *seq, uint64_t odd) { STR(seq, odd + 1); }

/* Reader side: s0 = acquire load (odd: retry); data as relaxed loads; acquire fence; s1 relaxed. */
static inline int seq_read_ok(const uint64_t *seq, uint64_t s0)
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return LD(seq) == s0;
}

/* ---- Region ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    /* per-mapping */
    Py_buffer view;
    int has_view;
    int writable;
    char *base;
    size_t len;
    /* set by init_control/check_control */
    int ready;
    uint32_t max_workers;
    uint64_t *tokens; /* tokens[row]: the token this Region claimed row with, 0 if none */
    /* last good config copy, used by picks when the config seqlock stays odd */
    uint64_t cfg_cache[CFG_WORDS];
    int cfg_cached;
    int cfg_stuck;          /* the last read exhausted its tries at sequence cfg_stuck_seq */
    uint64_t cfg_stuck_seq;
    /* stats */
    unsigned long long seq_retries;
    unsigned long long cfg_fallbacks;
} Region;

SD_HIDDEN extern PyTypeObject RegionType;

static inline uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Pointer to `size` bytes at `off` of the region, or NULL if they leave the mapping or `off` is
 * misaligned (the base itself is checked 8-byte aligned when the Region is made). */
static inline char *at(const Region *r, size_t off, size_t size, size_t align)
{
    int inside = off <= r->len && size <= r->len - off && (off & (align - 1)) == 0;
    return inside ? r->base + off : NULL;
}

/* Header words only: every caller first checked len >= HEADER_BYTES (check_control, or
 * init_control's size check) or is behind need_ready(), so these never yield NULL. */
#define U64(r, off) ((uint64_t *)at((r), (off), 8, 8))

/* Index of the k-th set bit of mask (k < popcount(mask)). */
static inline int nth_bit(uint64_t mask, uint64_t k)
{
    for (; k > 0; k--)
        mask &= mask - 1;
    return __builtin_ctzll(mask);
}

SD_HIDDEN int need_ready(Region *r, int write);
SD_HIDDEN char *row_at(Region *r, int64_t row);
SD_HIDDEN char *server_at(Region *r, int64_t slot);
SD_HIDDEN char *own_row(Region *r, int64_t row, int lost_ok);
SD_HIDDEN uint32_t rows_in_use(Region *r);
SD_HIDDEN int config_for_pick(Region *r, uint64_t *out);
SD_HIDDEN void row_add_pick(char *p, int slot, int64_t tokens);
/* Sums active requests (use_tokens 0) or tokens (1) of slots[0..n) over owned rows; -1 on error. */
SD_HIDDEN int sum_loads(Region *r, const int *slots, int n, int use_tokens, int64_t *sums);
/* Rotating choice among the set bits of `tied` (one fleet-wide ticket per role). */
SD_HIDDEN int pick_tied(Region *r, int role, uint64_t tied);

SD_HIDDEN int nargs_ok(const char *fn, Py_ssize_t nargs, Py_ssize_t want);
SD_HIDDEN int arg_i64(PyObject *o, int64_t *out);
SD_HIDDEN int arg_u64(PyObject *o, uint64_t *out);
SD_HIDDEN int arg_range(PyObject *o, int64_t lo, int64_t hi, const char *what, int64_t *out);

/* index.c */
SD_HIDDEN extern PyTypeObject IndexType;
SD_HIDDEN int index_add_constants(PyObject *m);

/* hash.c, sha256.c */
SD_HIDDEN PyObject *mod_token_ids_ok(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *mod_token_ids_int32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *mod_block_hashes_v1(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                                        PyObject *kwnames);
SD_HIDDEN PyObject *mod_block_hashes_v2(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                                        PyObject *kwnames);
SD_HIDDEN PyObject *mod_block_hashes_v2_64(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                                           PyObject *kwnames);
SD_HIDDEN PyObject *mod_sha256_impl(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *mod_v1_impl(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

/* sse.c: sse_scan's result bits */
#define SSE_INTERNAL 1
#define SSE_FINISHED 2
#define SSE_USAGE 4
#define SSE_DONE 8
SD_HIDDEN PyObject *mod_sse_scan(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
/* json_span.c */
SD_HIDDEN PyObject *mod_json_member(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

/* hashcache.c */
SD_HIDDEN extern PyTypeObject PrefixHashCacheType;

/* mapping.c: 2 MiB-aligned shared mappings and tmpfs huge pages for the index segments */
SD_HIDDEN extern PyTypeObject SharedMappingType;
SD_HIDDEN PyObject *mod_seed_huge(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

#endif
