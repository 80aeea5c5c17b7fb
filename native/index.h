/*
 * Shared declarations of the KV block index (native/index.c: segment lifecycle, KV events,
 * sweep, copy; native/picks.c: the workers' picks). Layout and concurrency: native/README.md.
 */
#ifndef SHMDISAGG_INDEX_H
#define SHMDISAGG_INDEX_H

#include "_native.h"
#include "hash.h"

/* ---- index segment layout (version 2): keep in step with native/README.md -------------- */

#define IX_MAGIC 0x3158444947534453ULL /* "SDSGIDX1" little-endian */
#define IX_VERSION 2u /* 2: slots of 16 + 16 x nw bytes, nw = the control segment's max_servers / 64 */
#define IX_HEADER_BYTES 4096u
#define IX_SLOT_BYTES 32u /* a slot of a table of 64 servers (nw 1); ix_slot_bytes(nw) in general */
#define IX_MIN_LOG2 4u
#define IX_MAX_LOG2 32u

#define X_MAGIC 0x000u
#define X_VERSION 0x008u  /* u32 version | u32 header_bytes << 32 */
#define X_GEN 0x010u
#define X_CAPLOG 0x018u   /* u32 cap_log2 | u32 slot_bytes << 32 */
#define X_SEGBYTES 0x020u
#define X_CREATED 0x028u
#define X_LIMIT 0x030u    /* most slots that may hold a key (insert_limit) */
#define X_STATE 0x038u    /* 0 building, 1 published, 2 retired: release store, acquire load */
#define X_MAXPROBE 0x080u /* own line: CAS-max by inserters */
#define X_USED 0x100u     /* own line: keys stored + reservations in flight (fetch_add) */

#define STATE_BUILDING 0u
#define STATE_PUBLISHED 1u
#define STATE_RETIRED 2u

/* Slot words: the key, then each server word's event and routed masks side by side (servers
 * 0..63 in words 1 and 2, as in a one-word slot), then the stamp. A slot of nw words per set is
 * 2 + 2 nw words: {key, event, routed, ts} (32 B) for 64 servers, 80 B for 256. Conversation
 * sessions (KIND_CONV) keep their server as a value, server + 1, in SL_RT(0) (0: none), so that
 * one CAS decides a session whatever the width. */
#define SL_KEY 0
#define SL_EV(w) (1 + 2 * (w))
#define SL_RT(w) (2 + 2 * (w))
#define SL_TS(nw) (1 + 2 * (nw))
#define SLOT_WORDS(nw) (2 + 2 * (nw))
static inline unsigned ix_slot_bytes(int nw) { return 8u * (unsigned)SLOT_WORDS(nw); }
_Static_assert(SLOT_WORDS(1) * 8 == IX_SLOT_BYTES, "a one-word slot is 32 bytes");

#define TS_KIND_SHIFT 62
#define TS_MASK ((1ULL << TS_KIND_SHIFT) - 1)
#define KIND_BLOCK 0ULL
#define KIND_CONV 1ULL
#define KIND_IMPL 2ULL

#define NS_CONV 0x6E6F6973726576ULL   /* namespace constants, mixed with the role */
#define NS_IMPL 0x7478657465727055ULL
#define NS_ROLE 0x9E3779B97F4A7C15ULL

#define REFRESH_NS 1000000000ULL /* a routed bit already set is re-stamped at most once a second */
#define PREFETCH 16              /* probes started ahead in walks and batches (a power of two) */
#ifndef JUMP
#define JUMP 32                  /* pick_kv's jump walk: one probe per JUMP blocks (a power of two) */
#endif
#ifndef JUMP_PREFETCH
#define JUMP_PREFETCH 4          /* probes the jump walk starts ahead, in windows */
#endif
#define IX_JUMP JUMP
_Static_assert(JUMP >= 2 && (JUMP & (JUMP - 1)) == 0, "JUMP is a power of two");
#define FOUND_STACK 2048         /* walks up to this many hashes keep their slots on the stack */
#define NOGIL_SLOTS 65536u       /* whole-table loops over more slots release the GIL */
#define DEFAULT_TPB 32           /* TensorRT-LLM's default when a server record has none */
#define CLAIM_TRIES 64

_Static_assert(X_STATE + 8 <= X_MAXPROBE && X_MAXPROBE + 8 <= X_USED, "index header lines");
_Static_assert(X_USED + 8 <= IX_HEADER_BYTES, "index header overflows");

typedef struct {
    PyObject_HEAD
    /* per-mapping */
    Py_buffer view;
    int has_view;
    int writable;
    char *base;
    size_t len;
    Region *ctl; /* strong reference: configuration, rows, publication, metrics */
    /* set by init_index/check_index */
    int ready;
    uint64_t generation, cap, mask, limit;
    unsigned shift; /* 64 - cap_log2: a key's home is the top bits of key * GOLDEN */
    int nw;         /* words of a server set: the control segment's max_servers / 64 */
    unsigned sw;    /* words of a slot: SLOT_WORDS(nw) */
    uint64_t *slots;
    /* calls running without the GIL; release() refuses while > 0 */
    int busy;
} Index;


/* The table key of a block hash (kind 0) or of a conversation key / implicit prefix hash. */
static inline uint64_t key_of(uint64_t h, uint64_t kind, int role)
{
    uint64_t k = h;
    if (kind != KIND_BLOCK)
        k = fmix64(h ^ (kind == KIND_CONV ? NS_CONV : NS_IMPL) ^ ((uint64_t)(role + 1) * NS_ROLE));
    return k != 0 ? k : 1;
}

static inline uint64_t *hdr(Index *ix, size_t off) { return (uint64_t *)(ix->base + off); }

/* Home slot of a key: Fibonacci hashing (one multiply; the top bits mix every key bit), cheaper
 * than a full finalizer in the walks, which probe one key per block. */
#define GOLDEN 0x9E3779B97F4A7C15ULL
static inline uint64_t home_of(Index *ix, uint64_t key) { return (key * GOLDEN) >> ix->shift; }
static inline uint64_t *slot_at(Index *ix, uint64_t i) { return ix->slots + (i & ix->mask) * ix->sw; }
/* The same with the slot width a caller knows at compile time (nw 1: 4 words). */
INLINE uint64_t *slot_at_nw(Index *ix, uint64_t i, int nw) { return ix->slots + (i & ix->mask) * SLOT_WORDS(nw); }

static inline uint64_t max_probe(Index *ix)
{
    uint64_t mp = LD(hdr(ix, X_MAXPROBE));
    return mp < ix->cap ? mp : ix->cap - 1; /* untrusted: clamp */
}

/* The slot holding `key` (whose home slot is `home`), or NULL; probes at most maxp + 1 slots. */
INLINE uint64_t *ix_find_at_nw(Index *ix, uint64_t key, uint64_t home, uint64_t maxp, int nw)
{
    uint64_t *s, k;
    for (uint64_t d = 0; d <= maxp; d++) {
        s = slot_at_nw(ix, home + d, nw);
        k = LDA(&s[SL_KEY]);
        if (k == key)
            return s;
        if (k == 0)
            break;
    }
    return NULL;
}

static inline uint64_t *ix_find_at(Index *ix, uint64_t key, uint64_t home, uint64_t maxp)
{
    return ix->nw == 1 ? ix_find_at_nw(ix, key, home, maxp, 1) : ix_find_at_nw(ix, key, home, maxp, ix->nw);
}

static inline uint64_t *ix_find(Index *ix, uint64_t key, uint64_t maxp)
{
    return ix_find_at(ix, key, home_of(ix, key), maxp);
}

static inline void count_full(Index *ix) { ADD(U64(ix->ctl, IC_FULL_DROPS), 1); }

/* Insert reservations (index.c): `used` counts keys stored plus reservations, and none is
 * granted past insert_limit. A caller inserting many keys reserves them in one fetch_add and
 * gives back what it did not use; ix_upsert reserves one slot per insert. */
typedef struct {
    uint64_t left;
} Budget;

SD_HIDDEN void budget_take(Index *ix, Budget *b, uint64_t want);
SD_HIDDEN void budget_return(Index *ix, Budget *b);
/* The slot holding `key`, inserting it by CAS if absent; NULL (counted when `count`) when full. */
SD_HIDDEN uint64_t *ix_upsert_b(Index *ix, uint64_t key, int count, Budget *b);

static inline uint64_t *ix_upsert(Index *ix, uint64_t key, int count)
{
    return ix_upsert_b(ix, key, count, NULL);
}

static inline void prefetch_key(Index *ix, uint64_t key)
{
    __builtin_prefetch(slot_at(ix, home_of(ix, key)));
}

/* Mark server `server` routed on slot s at `now`: stamp first, then fetch_or (release) of its
 * bit in its routed word, so a sweep that sees the bit sees the fresh stamp. A bit already set
 * with a stamp under a second old is left alone, so hot prefix blocks stay shared in every
 * core's cache. */
INLINE void routed_set(uint64_t *s, int server, uint64_t now, uint64_t kind, int nw)
{
    uint64_t *rw = &s[SL_RT(server >> 6)], *tw = &s[SL_TS(nw)], bit = 1ULL << (server & 63);
    uint64_t r = LD(rw), ts = LD(tw), stamp = (now & TS_MASK) | kind << TS_KIND_SHIFT;
    if ((r & bit) && (ts >> TS_KIND_SHIFT) == kind && now - (ts & TS_MASK) < REFRESH_NS)
        return;
    ST(tw, stamp);
    if (!(r & bit))
        __atomic_fetch_or(rw, bit, __ATOMIC_RELEASE);
}

/* The server of a conversation session's value (SL_RT(0): server + 1), -1 for none or a value
 * past the table (untrusted bytes). */
static inline int session_server(uint64_t v, int nw) { return v != 0 && v <= 64u * (uint64_t)nw ? (int)(v - 1) : -1; }

/* ---- shared helpers (index.c) ----------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int has_view;
    const uint64_t *h;
    Py_ssize_t n;
} Hashes;

/* Packed u64 hashes from bytes or an aligned buffer; 0 with TypeError. */
SD_HIDDEN int hashes_open(PyObject *o, Hashes *hb);
SD_HIDDEN void hashes_close(Hashes *hb);
SD_HIDDEN int arg_double(PyObject *o, const char *what, double *out);
/* Usable for reads (write 0), slot writes (1), or coordinator writes to the control metrics (2). */
SD_HIDDEN int ix_ok(Index *self, int write);

/* The control segment publishes another generation: a worker's pick returns None to remap. */
static inline int stale(Index *self) { return LDA(U64(self->ctl, IP_GEN)) != self->generation; }

/* ---- picks (picks.c) -------------------------------------------------------------------- */

SD_HIDDEN PyObject *Index_pick_kv(Index *self, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *Index_pick_kv_claim(Index *self, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *Index_commit_routed(Index *self, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *Index_match(Index *self, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *Index_conv_pick_explicit(Index *self, PyObject *const *args, Py_ssize_t nargs);
SD_HIDDEN PyObject *Index_conv_pick_implicit(Index *self, PyObject *const *args, Py_ssize_t nargs);

#endif
