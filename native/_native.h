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

/* ---- control layout (version 5): keep in step with native/README.md -------------------- */

#define MAGIC 0x31564C5447534453ULL /* "SDSGTLV1" little-endian */
#define LAYOUT_VERSION 5u /* 2: index publication, index metrics; 3: log-linear lag histogram;
                              4: a row records its fleet index (W_FLEET); 5: server sets of
                              max_servers bits (64..256, chosen at create), the config block,
                              retired totals, server records and worker rows at offsets computed
                              from it (control_layout) */
#define HEADER_BYTES 4096u
#define MAX_SERVERS_LIMIT 256u  /* the widest table: server sets of 4 words */
#define DEFAULT_MAX_SERVERS 64u /* one word: the table of a deployment of up to 64 executors */
#define SW_MAX (MAX_SERVERS_LIMIT / 64u)
#define MAX_ROLES 2u
#define SERVER_STRIDE 256u
#define MAX_WORKERS_LIMIT 4096u
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
#define H_CONFIG 0x040u   /* u32 off_config | u32 off_retired << 32 */
#define INIT_READY 1u

/* coordinator line */
#define OFF_COORD 0x080u
#define C_PID 0x080u
#define C_START 0x088u
#define C_INC 0x090u
#define C_HEARTBEAT 0x098u
#define C_STATE 0x0A0u

/* worker-written shared lines */
#define OFF_RR 0x180u /* rr[role] at OFF_RR + role * 128 */
#define RR_STRIDE 128u
#define OFF_ROWS_LINE 0x280u
#define RL_HWM 0x280u      /* 1 + highest row index ever claimed (CAS-max by claimers) */
#define RL_CLAIM_SEQ 0x288u /* claim counter, low 32 bits of every token */

/* coordinator-written totals of reclaimed rows (retired_routed[max_servers] lies past the header) */
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

/* Past the header, at offsets computed from max_servers (control_layout; nw = max_servers / 64):
 * the config block (seqlock, coordinator) at off_config = HEADER_BYTES: seq, servers_version,
 * then present[nw], healthy[nw], role_mask[0][nw] (context), role_mask[1][nw] (generation),
 * padded to 128 B; retired_routed[max_servers] u64 at off_retired; the server records,
 * max_servers x 256 B, at off_servers; the worker rows, max_workers x worker_stride, at
 * off_workers. */
#define OFF_CONFIG HEADER_BYTES
#define CFG_SEQ 0u     /* offsets in the config block */
#define CFG_VERSION 8u
#define CFG_MASKS 16u  /* present at +16, healthy at +16 + 8 nw, role_mask[r] at +16 + 8 nw (2 + r) */
#define CFG_SETS 4u    /* present, healthy, role 0, role 1 */

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

/* worker row: a 128-byte head, then active_req[max_servers] i32, active_tok[max_servers] i64,
 * routed[max_servers] u64 (picks of each server, monotonic); the stride is 128 + 20 x
 * max_servers (1408 B for 64 servers, 5248 for 256), a multiple of 128 */
#define W_TOKEN 0u
#define W_START 8u
#define W_HEARTBEAT 16u
#define W_IDXGEN 24u
#define W_COORDINC 32u
#define W_DISPATCHED 40u
#define W_COMPLETED 48u
#define W_PID 56u
#define W_FLEET 64u /* fleet index + 1 of the owner (0: not a fleet worker), for a restarted coordinator */
#define W_ACTIVE_REQ 128u /* i32[max_servers]; active_tok and routed follow (Region.w_tok, .w_routed) */
#define TOKEN_FREE 0ULL
#define TOKEN_RECLAIMING (~0ULL)

_Static_assert(C_STATE + 8 <= OFF_RR, "coordinator line overlaps the tickets");
_Static_assert(H_CONFIG + 8 <= OFF_COORD, "header words overlap the coordinator line");
_Static_assert(OFF_RR + MAX_ROLES * RR_STRIDE <= OFF_ROWS_LINE, "rr tickets overlap");
_Static_assert(RL_CLAIM_SEQ + 8 <= RET_COMPLETED, "row line overlaps the retired totals");
_Static_assert(RET_DISPATCHED + 8 <= OFF_IDXPUB, "retired totals overlap the index publication");
_Static_assert(IP_NAME + IP_NAME_BYTES <= OFF_IDXMET, "index publication overflows its line");
_Static_assert(IM_WORD(IM_WORDS) <= OFF_IDXCNT, "index metrics overflow");
_Static_assert(IC_RACE_RERUNS + 8 <= OFF_LAGHIST, "index counters overflow");
_Static_assert(OFF_LAGHIST + 8 * LAG_BUCKETS <= HEADER_BYTES, "header overflows 4096 bytes");
_Static_assert(S_ADDR + ADDR_BYTES <= SERVER_STRIDE, "server record overflows its stride");
_Static_assert(W_FLEET + 8 <= W_ACTIVE_REQ, "row head overflows");
_Static_assert(SERVER_STRIDE % 128 == 0 && MAX_SERVERS_LIMIT % 64 == 0, "records pad to 128 B");
_Static_assert(MAX_SERVERS_LIMIT <= 0xFFFF, "max_servers is a u16 in the header");

/* Where everything past the header lies for `max_servers` (a multiple of 64 in
 * 64..MAX_SERVERS_LIMIT) and `max_workers` rows; every offset a multiple of 128. */
typedef struct {
    size_t off_config, off_retired, off_servers, off_workers, worker_stride, bytes;
} ControlLayout;

static inline ControlLayout control_layout(uint32_t max_servers, uint32_t max_workers)
{
    ControlLayout l;
    size_t nw = max_servers / 64u;
    l.off_config = OFF_CONFIG;
    l.off_retired = l.off_config + ((CFG_MASKS + 8u * CFG_SETS * nw + 127u) & ~(size_t)127u);
    l.off_servers = l.off_retired + 8u * (size_t)max_servers;
    l.off_workers = l.off_servers + (size_t)max_servers * SERVER_STRIDE;
    l.worker_stride = W_ACTIVE_REQ + 20u * (size_t)max_servers;
    l.bytes = l.off_workers + (size_t)max_workers * l.worker_stride;
    return l;
}

/* ---- server sets ------------------------------------------------------------------------ */

/* A set of server slots: bit s of word s / 64. Only the first `nw` (max_servers / 64) words are
 * meaningful. Functions taking `nw` are always inlined, so that a caller passing the constant 1
 * (a table of 64 servers: dispatch on `nw == 1`) compiles to the one-word code. */
typedef struct {
    uint64_t w[SW_MAX];
} Set;

#define INLINE static inline __attribute__((always_inline))

INLINE int set_any(const Set *s, int nw)
{
    uint64_t o = 0;
    for (int i = 0; i < nw; i++)
        o |= s->w[i];
    return o != 0;
}

INLINE int set_has(const Set *s, int nw, int64_t b)
{
    return b >= 0 && b < 64 * (int64_t)nw && ((s->w[b >> 6] >> (b & 63)) & 1);
}

INLINE uint64_t set_count(const Set *s, int nw)
{
    uint64_t n = 0;
    for (int i = 0; i < nw; i++)
        n += (uint64_t)__builtin_popcountll(s->w[i]);
    return n;
}

/* The members of s in ascending order into out[]; returns how many. */
INLINE int set_slots(const Set *s, int nw, int *out)
{
    int n = 0;
    for (int i = 0; i < nw; i++)
        for (uint64_t m = s->w[i]; m != 0; m &= m - 1)
            out[n++] = 64 * i + __builtin_ctzll(m);
    return n;
}

/* Index of the k-th set bit of mask (k < popcount(mask)). */
static inline int nth_bit(uint64_t mask, uint64_t k)
{
    for (; k > 0; k--)
        mask &= mask - 1;
    return __builtin_ctzll(mask);
}

/* The k-th member (k < set_count) of s. */
INLINE int set_nth(const Set *s, int nw, uint64_t k)
{
    int i = 0;
    for (uint64_t c; i < nw - 1 && k >= (c = (uint64_t)__builtin_popcountll(s->w[i])); i++)
        k -= c;
    return 64 * i + nth_bit(s->w[i], k);
}

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

/* The config block as one consistent copy (the first `nw` words of each set are read). */
typedef struct {
    Set present, healthy, role[MAX_ROLES];
    uint64_t version;
} Config;

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
    uint32_t max_servers; /* a multiple of 64 in 64..MAX_SERVERS_LIMIT */
    int nw;               /* max_servers / 64: words of a server set */
    size_t off_config, off_retired, off_servers, off_workers, worker_stride;
    size_t w_tok, w_routed; /* row offsets of active_tok[max_servers] and routed[max_servers] */
    uint64_t *tokens; /* tokens[row]: the token this Region claimed row with, 0 if none */
    /* last good config copy, used by picks when the config seqlock stays odd */
    Config cfg_cache;
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

/* Server record `slot`, unchecked: only for a slot < max_servers of a validated Region (a member
 * of a candidate set), whose records lie inside the mapping (check_control). */
static inline char *server_rec(const Region *r, int slot) { return r->base + r->off_servers + (size_t)slot * SERVER_STRIDE; }

SD_HIDDEN int need_ready(Region *r, int write);
SD_HIDDEN char *row_at(Region *r, int64_t row);
SD_HIDDEN char *server_at(Region *r, int64_t slot);
SD_HIDDEN char *own_row(Region *r, int64_t row, int lost_ok);
SD_HIDDEN uint32_t rows_in_use(Region *r);
SD_HIDDEN int config_for_pick(Region *r, Config *out);
SD_HIDDEN void row_add_pick(Region *r, char *p, int slot, int64_t tokens);
/* Sums active requests (use_tokens 0) or tokens (1) of slots[0..n) over owned rows; -1 on error. */
SD_HIDDEN int sum_loads(Region *r, const int *slots, int n, int use_tokens, int64_t *sums);
/* Rotating choice among tied[0..n) (ascending slots, n >= 1; one fleet-wide ticket per role). */
SD_HIDDEN int pick_tied(Region *r, int role, const int *tied, int n);
/* A Python int of the `nw`-word set (bit s: server s). */
SD_HIDDEN PyObject *set_to_long(const Set *s, int nw);

/* Word `w` of one of the config block's sets (CFG_SETS: 0 present, 1 healthy, 2 + role). */
static inline uint64_t *cfg_word(Region *r, unsigned set, int w)
{
    return (uint64_t *)(r->base + r->off_config + CFG_MASKS + 8u * ((size_t)set * (size_t)r->nw + (size_t)w));
}

static inline uint64_t *cfg_seq(Region *r) { return (uint64_t *)(r->base + r->off_config + CFG_SEQ); }
static inline uint64_t *cfg_version(Region *r) { return (uint64_t *)(r->base + r->off_config + CFG_VERSION); }

/* Seqlock read of the config block into *out (nw words per set); 0 after SEQ_TRIES failed tries. */
INLINE int config_read_nw(Region *r, Config *out, uint64_t *last_seq, int nw)
{
    const uint64_t *seq = cfg_seq(r), *w = cfg_word(r, 0, 0);
    uint64_t s0 = 0;
    int tries, ok = 0;
    for (tries = 0; tries < SEQ_TRIES && !ok; tries++) {
        s0 = LDA(seq);
        if ((s0 & 1) == 0) {
            for (int i = 0; i < nw; i++) {
                out->present.w[i] = LD(&w[i]);
                out->healthy.w[i] = LD(&w[nw + i]);
                out->role[0].w[i] = LD(&w[2 * nw + i]);
                out->role[1].w[i] = LD(&w[3 * nw + i]);
            }
            out->version = LD(cfg_version(r));
            ok = seq_read_ok(seq, s0);
        }
        if (!ok)
            cpu_relax();
    }
    r->seq_retries += (unsigned long long)(tries - 1);
    *last_seq = s0;
    return ok;
}

INLINE void config_copy(Config *dst, const Config *src, int nw)
{
    for (int i = 0; i < nw; i++) {
        dst->present.w[i] = src->present.w[i];
        dst->healthy.w[i] = src->healthy.w[i];
        dst->role[0].w[i] = src->role[0].w[i];
        dst->role[1].w[i] = src->role[1].w[i];
    }
    dst->version = src->version;
}

/* Config for a pick: a fresh copy, else this Region's last good copy, else RetryExhausted. A
 * sequence that stays at the value that already exhausted us goes straight to the copy. */
INLINE int config_for_pick_nw(Region *r, Config *out, int nw)
{
    uint64_t last = 0;
    int fresh = 0, ok = 1;
    if (!(r->cfg_stuck && LD(cfg_seq(r)) == r->cfg_stuck_seq))
        fresh = config_read_nw(r, out, &last, nw);
    if (fresh) {
        config_copy(&r->cfg_cache, out, nw);
        r->cfg_cached = 1;
        r->cfg_stuck = 0;
    } else if (r->cfg_cached) {
        if (!r->cfg_stuck) {
            r->cfg_stuck = 1;
            r->cfg_stuck_seq = last;
        }
        r->cfg_fallbacks++;
        config_copy(out, &r->cfg_cache, nw);
    } else {
        PyErr_Format(RetryExhausted, "config block sequence stayed odd (%llu) for %d tries: the "
                     "coordinator died mid-write or is stalled", (unsigned long long)last, SEQ_TRIES);
        ok = 0;
    }
    return ok;
}

/* Candidates of a pick: present & healthy & role_mask[role], less `exclude` (if a slot). */
INLINE void candidates(const Config *c, int role, int64_t exclude, int nw, Set *out)
{
    for (int i = 0; i < nw; i++)
        out->w[i] = c->present.w[i] & c->healthy.w[i] & c->role[role].w[i];
    if (exclude >= 0 && exclude < 64 * (int64_t)nw)
        out->w[exclude >> 6] &= ~(1ULL << (exclude & 63));
}

SD_HIDDEN int nargs_ok(const char *fn, Py_ssize_t nargs, Py_ssize_t want);
SD_HIDDEN int arg_i64(PyObject *o, int64_t *out);
SD_HIDDEN int arg_u64(PyObject *o, uint64_t *out);
SD_HIDDEN int arg_range(PyObject *o, int64_t lo, int64_t hi, const char *what, int64_t *out);

/* The server slot argument of a call: 0..max_servers - 1 (ValueError otherwise). */
static inline int arg_slot(Region *r, PyObject *o, int64_t *out)
{
    return arg_range(o, 0, (int64_t)r->max_servers - 1, "server slot", out);
}

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
/* json_span.c: the value of the last top-level member `key` of the JSON object document in
 * [s, end), or NULL (absent, or the walk cannot tell: json_span.c's comment); *found_end is past
 * it. `hook`, if not NULL, is called on each matching member's value: it returns where the value
 * ends if it read it, or NULL to have it skipped as usual. */
typedef const char *(*json_value_hook)(const char *value, const char *end, void *ctx);
/* Past JSON whitespace (space, tab, newline, carriage return) from p. */
static inline const char *json_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}
SD_HIDDEN const char *json_member_span(const char *s, const char *end, const char *key, Py_ssize_t klen,
                                       json_value_hook hook, void *ctx, const char **found_end);
SD_HIDDEN PyObject *mod_json_member(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
/* json_ids.c */
SD_HIDDEN PyObject *mod_json_token_ids(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *mod_json_long_digits(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

/* hashcache.c */
SD_HIDDEN extern PyTypeObject PrefixHashCacheType;

/* mapping.c: 2 MiB-aligned shared mappings and tmpfs huge pages for the index segments */
SD_HIDDEN extern PyTypeObject SharedMappingType;
SD_HIDDEN PyObject *mod_seed_huge(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

#endif
