/*
 * PrefixHashCache: a worker-local cache of v1 block keys by prompt prefix, so a prompt that
 * extends or repeats one seen before (a conversation's next turn, a shared system prompt or
 * document) is not rehashed through v1's serial chain (about 1.2 ns a token).
 *
 * For every block the cache computes a 128-bit chained fingerprint: two NH sums of the block's
 * tokens under random per-process keys (pairs of 32-bit adds multiplied into a 64-bit sum, eight
 * tokens per AVX2 step: no per-token serial chain), each kept as four lane sums folded into four
 * polynomial chains c = c * P + s with a random odd P, combined into 64 bits where the cache reads
 * a fingerprint (hash.h, FpArgs: ~0.13 ns a token against v1's 1.3). The fingerprint of
 * block j therefore stands for the whole prefix 0..j, like the v1 key it replaces. Records: the
 * v1 keys of every prompt hashed are appended to a ring (`arena`); a 2-way table (buckets of two
 * entries in one cache line) maps the fingerprint of every CHECKPOINT-th block and of the last
 * block of a record to (record start, block). A lookup checks the last block first (a repeat),
 * then binary-searches the checkpoints for the deepest cached one, copies the v1 keys up to it and
 * hashes only the rest, then records the whole prompt. An aligned int32 buffer is read in place;
 * lists and int64 buffers are copied to u32 first.
 *
 * A false match needs both 64-bit fingerprints to collide under keys the process drew at random
 * (NH is 2^-32-almost-universal per lane and key set, the two key sets are independent, and the
 * lanes are combined with random odd weights); its only effect would be one mis-scored routing
 * decision. An int32 miss computes its fingerprints inside the v1 loop (hash.c v1_run_u32). The
 * cache is process-local and keeps the GIL (a plain C structure, no shared memory). Memory: 8
 * bytes per cached block plus 32 bytes per table entry (max_blocks / 4 entries, rounded up to a
 * power of two), in one private mapping advised for transparent huge pages (map_zeroed).
 */
#include "hash.h"

#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif


typedef struct {
    uint64_t c1, c2; /* fingerprint of blocks 0..pos of the record */
    uint64_t start;  /* arena position (monotonic) of the record's block 0 */
    uint64_t pos;
} Entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t tpb;
    uint32_t *keys;    /* NH keys: k1[0..tpb+2) then k2[0..tpb+2) */
    uint64_t lane1[4], lane2[4], p1, p2, r1[4], r2[4]; /* fingerprint keys (hash.h FpArgs) */
    uint64_t *arena;   /* ring of v1 keys */
    uint64_t arena_len, head;
    Entry *table;
    uint64_t table_mask;
    void *map;         /* one private mapping: the table, then the arena */
    size_t map_len;
    /* stats */
    unsigned long long calls, full_hits, blocks_reused, blocks_hashed;
} PrefixHashCache;


static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The fingerprints of tok[0..usable)'s blocks that the cache reads (fp_wanted: every CHECKPOINT-th
 * block and the last), into fp[2b], fp[2b+1]: NH lane sums per block, four lane chains per key,
 * combined where read (hash.h, FpArgs). */
static void fingerprints_scalar(const uint32_t *tok, Py_ssize_t usable, const FpArgs *f, uint64_t *fp)
{
    Py_ssize_t nb = (usable + f->tpb - 1) / f->tpb;
    uint64_t c1[4], c2[4];
    memcpy(c1, f->c1, sizeof c1);
    memcpy(c2, f->c2, sizeof c2);
    for (Py_ssize_t b = 0, start = 0; start < usable; b++, start += f->tpb) {
        Py_ssize_t len = usable - start < f->tpb ? usable - start : f->tpb;
        uint64_t s1[4] = {0, 0, 0, 0}, s2[4] = {0, 0, 0, 0};
        nh_lanes(tok + start, 0, len, f->k1, f->k2, s1, s2);
        lanes_step(c1, c2, f, s1, s2, len);
        if (fp_wanted(b, nb))
            lanes_fold(c1, c2, f, fp, b);
    }
}

#if defined(__x86_64__)
/* Eight tokens per step, their four pairs in the four lanes; no horizontal sum per block. */
__attribute__((target("avx2"))) static void fingerprints_avx2(const uint32_t *tok, Py_ssize_t usable,
                                                              const FpArgs *f, uint64_t *fp)
{
    Py_ssize_t nb = (usable + f->tpb - 1) / f->tpb;
    uint64_t c1[4], c2[4], s1[4], s2[4];
    const uint32_t *k1 = f->k1, *k2 = f->k2;
    __m256i C1 = _mm256_loadu_si256((const __m256i *)f->c1), C2 = _mm256_loadu_si256((const __m256i *)f->c2);
    __m256i P1 = _mm256_set1_epi64x((long long)f->p1), P2 = _mm256_set1_epi64x((long long)f->p2);
    for (Py_ssize_t b = 0, start = 0; start < usable; b++, start += f->tpb) {
        Py_ssize_t len = usable - start < f->tpb ? usable - start : f->tpb, i = 0;
        const uint32_t *t = tok + start;
        __m256i v1 = _mm256_setzero_si256(), v2 = _mm256_setzero_si256();
        for (; i + 8 <= len; i += 8) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(t + i));
            v1 = nh8(x, k1 + i, v1);
            v2 = nh8(x, k2 + i, v2);
        }
        if (i < len) { /* a tail of under 8 tokens: its pairs continue the lanes (i % 8 == 0) */
            _mm256_storeu_si256((__m256i *)s1, v1);
            _mm256_storeu_si256((__m256i *)s2, v2);
            nh_lanes(t, i, len, k1, k2, s1, s2);
            v1 = _mm256_loadu_si256((const __m256i *)s1);
            v2 = _mm256_loadu_si256((const __m256i *)s2);
        }
        lanes_step8(&C1, &C2, P1, P2, v1, v2, _mm256_set_epi64x(0, 0, 0, (long long)((uint64_t)len << 48)),
                    _mm256_set_epi64x(0, 0, 0, (long long)((uint64_t)len << 40)));
        if (fp_wanted(b, nb)) {
            _mm256_storeu_si256((__m256i *)c1, C1);
            _mm256_storeu_si256((__m256i *)c2, C2);
            lanes_fold(c1, c2, f, fp, b);
        }
    }
}
#endif

static void fingerprints(const uint32_t *tok, Py_ssize_t usable, const FpArgs *f, uint64_t *fp)
{
#if defined(__x86_64__)
    if (v1_avx2()) {
        fingerprints_avx2(tok, usable, f, fp);
        return;
    }
#endif
    fingerprints_scalar(tok, usable, f, fp);
}

/* Zeroed private memory for the table and the arena. From 1 MiB on it is 2 MiB-aligned and
 * advised for transparent huge pages: a lookup then costs no page walk, where the 4 KiB pages of a
 * few MiB, pushed out of the TLB by the index walk of every pick, cost a serialised walk each
 * (about 85 ns on the development VM). Without THP (or MADV_HUGEPAGE) it is plain pages. */
static void *map_zeroed(size_t bytes, size_t *mapped)
{
    const size_t huge = (size_t)2 << 20, page = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = bytes >= huge / 2 ? (bytes + huge - 1) & ~(huge - 1) : (bytes + page - 1) & ~(page - 1);
    size_t extra = len >= huge ? huge : 0;
    char *p = mmap(NULL, len + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), *a;
    if (p == MAP_FAILED)
        return NULL;
    a = p;
    if (extra != 0) {
        a = (char *)(((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1));
        if (a > p)
            munmap(p, (size_t)(a - p));
        if (a + len < p + len + extra)
            munmap(a + len, (size_t)(p + len + extra - (a + len)));
#ifdef MADV_HUGEPAGE
        madvise(a, len, MADV_HUGEPAGE);
#endif
    }
    *mapped = len;
    return a;
}

static int Cache_init(PrefixHashCache *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tokens_per_block", "max_blocks", "seed", NULL};
    Py_ssize_t tpb = 0, max_blocks = 1 << 21, entries = 2;
    PyObject *seed_obj = Py_None;
    uint64_t state = 0;
    int rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|nO:PrefixHashCache", kwlist, &tpb, &max_blocks,
                                     &seed_obj))
        goto fail;
    if (self->map != NULL) {
        PyErr_SetString(PyExc_TypeError, "PrefixHashCache is already initialised");
        goto fail;
    }
    if (tpb < 1 || tpb > (1 << 20) || max_blocks < CHECKPOINT || max_blocks > ((Py_ssize_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "need 1 <= tokens_per_block <= 2**20 and "
                        "16 <= max_blocks <= 2**32");
        goto fail;
    }
    if (seed_obj != Py_None) {
        if (!arg_u64(seed_obj, &state))
            goto fail;
    } else if (getrandom(&state, sizeof state, 0) != (ssize_t)sizeof state) {
        state = monotonic_ns() ^ (uint64_t)(uintptr_t)self;
    }
    while (entries < max_blocks / 4)
        entries <<= 1;
    self->tpb = tpb;
    self->arena_len = (uint64_t)max_blocks;
    self->table_mask = (uint64_t)entries - 1;
    self->keys = PyMem_Malloc(2 * ((size_t)tpb + 2) * sizeof(uint32_t));
    self->map = map_zeroed((size_t)entries * sizeof(Entry) + (size_t)max_blocks * sizeof(uint64_t),
                           &self->map_len);
    if (self->keys == NULL || self->map == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    self->table = self->map; /* page-aligned: a bucket is one cache line */
    self->arena = (uint64_t *)(self->table + entries);
    for (Py_ssize_t i = 0; i < 2 * (tpb + 2); i++)
        self->keys[i] = (uint32_t)splitmix64(&state);
    for (int l = 0; l < 4; l++) {
        self->lane1[l] = splitmix64(&state);
        self->lane2[l] = splitmix64(&state);
        self->r1[l] = splitmix64(&state) | 1; /* odd: a difference in any one lane shows */
        self->r2[l] = splitmix64(&state) | 1;
    }
    self->head = 0;
    /* odd multipliers below 2**32 (one AVX2 multiply a lane chain): each step is a bijection of c */
    self->p1 = (splitmix64(&state) & 0xFFFFFFFFULL) | 1;
    self->p2 = (splitmix64(&state) & 0xFFFFFFFFULL) | 1;
    rc = 0;
fail:
    return rc;
}

static void Cache_dealloc(PrefixHashCache *self)
{
    PyMem_Free(self->keys);
    if (self->map != NULL)
        munmap(self->map, self->map_len);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A record is usable while it is whole in the arena ring. */
static inline int entry_whole(const PrefixHashCache *self, const Entry *e)
{
    return (e->c1 | e->c2) != 0 && e->start + e->pos < self->head && self->head - e->start <= self->arena_len;
}

/* The bucket of fingerprint (c1, c2): two entries in one 64-byte line (2-way associative, so a
 * checkpoint is lost only when two newer ones land in its bucket). */
static inline Entry *bucket_of(PrefixHashCache *self, uint64_t c1)
{
    return &self->table[(fmix64(c1) & self->table_mask) & ~(uint64_t)1];
}

/* Prefetching what a next turn's lookup reads and its record writes. The cache's lines are cold
 * at every decision (the pick and the request's JSON in between push them out), and a 32k-token
 * prompt reads ~8 buckets one after the other in its binary search and records 64 buckets and
 * 8 KiB of arena. Prefetched before the search and the v1 chain of the new blocks, they arrive
 * meanwhile: ~1.5-2.5 us less a 32k next turn (BENCHMARKS.md). A prefetch that misses the TLB
 * holds up retirement until its page walk is done (a chain with one prefetch a block ran 2x
 * slower on the development VM), so a demand load first puts the table's and the arena's huge
 * pages in the TLB. (Prefetching a miss's record ahead of its chain measured no gain.) */
static void warm_tlb(PrefixHashCache *self)
{
    volatile uint64_t sink = self->table[0].pos + self->arena[self->head % self->arena_len];
    (void)sink;
}

/* The arena lines a record of nb blocks will write (for writing). */
static void prefetch_record(PrefixHashCache *self, Py_ssize_t nb)
{
    uint64_t at = self->head % self->arena_len;
    if ((uint64_t)nb <= self->arena_len)
        for (Py_ssize_t i = 0; i < nb; i += 8) /* eight keys a line */
            __builtin_prefetch(self->arena + (at + (uint64_t)i) % self->arena_len, 1);
}

/* The buckets of every checkpoint and of the last block (the search reads them, the record
 * writes them). */
static void prefetch_buckets(PrefixHashCache *self, const uint64_t *fp, Py_ssize_t nb)
{
    for (Py_ssize_t b = CHECKPOINT - 1; b < nb - 1; b += CHECKPOINT)
        __builtin_prefetch(bucket_of(self, fp[2 * b]), 1);
    __builtin_prefetch(bucket_of(self, fp[2 * (nb - 1)]), 1);
}

/* The table entry for fingerprint (c1, c2) if it names a record still whole in the arena. */
static Entry *cache_find(PrefixHashCache *self, uint64_t c1, uint64_t c2, uint64_t pos)
{
    Entry *e = bucket_of(self, c1);
    for (int w = 0; w < 2; w++, e++)
        if (e->c1 == c1 && e->c2 == c2 && e->pos == pos && entry_whole(self, e))
            return e;
    return NULL;
}

static void arena_copy_out(PrefixHashCache *self, uint64_t start, uint64_t *out, Py_ssize_t n)
{
    uint64_t at = start % self->arena_len, first = self->arena_len - at < (uint64_t)n ? self->arena_len - at : (uint64_t)n;
    memcpy(out, self->arena + at, first * 8);
    if ((uint64_t)n > first)
        memcpy(out + first, self->arena, ((uint64_t)n - first) * 8);
}

static uint64_t arena_append(PrefixHashCache *self, const uint64_t *v, Py_ssize_t n)
{
    uint64_t start = self->head, at = start % self->arena_len;
    uint64_t first = self->arena_len - at < (uint64_t)n ? self->arena_len - at : (uint64_t)n;
    memcpy(self->arena + at, v, first * 8);
    if ((uint64_t)n > first)
        memcpy(self->arena, v + first, ((uint64_t)n - first) * 8);
    self->head += (uint64_t)n;
    return start;
}

/* Record (c1, c2) -> (start, pos): over the same fingerprint, else over an entry whose record
 * left the ring, else over the older of the two. */
static void cache_put(PrefixHashCache *self, uint64_t c1, uint64_t c2, uint64_t start, uint64_t pos)
{
    Entry *b = bucket_of(self, c1), *e;
    if ((b[0].c1 == c1 && b[0].c2 == c2) || !entry_whole(self, &b[0]))
        e = &b[0];
    else if ((b[1].c1 == c1 && b[1].c2 == c2) || !entry_whole(self, &b[1]))
        e = &b[1];
    else
        e = b[0].start <= b[1].start ? &b[0] : &b[1];
    e->c1 = c1;
    e->c2 = c2;
    e->start = start;
    e->pos = pos;
}

/* block_hashes(tokens, salt_id=None) -> bytes: v1 keys (u64 LE per block), as block_hashes_v1. */
static PyObject *Cache_block_hashes(PrefixHashCache *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    PyObject *result = NULL, *salt_obj = NULL;
    Tokens t, view;
    const uint32_t *tok;
    uint32_t *own = NULL; /* a copy of the tokens' low 32 bits, unless the buffer is int32 already */
    uint64_t *fp = NULL, *out, salt = 0, start;
    FpArgs fa;
    const uint32_t *k1 = self->keys, *k2 = self->keys + self->tpb + 2;
    Py_ssize_t usable, nb, tpb = self->tpb, q_count, lo, hi, best = -1, reuse = 0, head_blocks;
    Py_ssize_t head_tokens;
    int salted = 0, opened = 0, direct;
    Entry *e;
    if (nargs < 1 || nargs > 2 || (kwnames != NULL && (PyTuple_GET_SIZE(kwnames) != 1 || nargs != 1 ||
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "salt_id") != 0))) {
        PyErr_SetString(PyExc_TypeError, "block_hashes(tokens, salt_id=None)");
        goto fail;
    }
    salt_obj = nargs == 2 ? args[1] : kwnames != NULL ? args[1] : NULL;
    if (self->arena == NULL) {
        PyErr_SetString(PyExc_ValueError, "PrefixHashCache is not initialised");
        goto fail;
    }
    if (!opt_u64(salt_obj, "salt_id", &salted, &salt) || !(opened = tokens_open(args[0], &t)))
        goto fail;
    usable = t.n > 0 ? t.n - 1 : 0;
    nb = (usable + tpb - 1) / tpb;
    self->calls++;
    if ((result = PyBytes_FromStringAndSize(NULL, nb * 8)) == NULL || nb == 0)
        goto fail;
    out = (uint64_t *)PyBytes_AS_STRING(result);
    direct = t.items == NULL && t.itemsize == 4 && ((uintptr_t)t.buf & 3) == 0;
    if (!direct)
        own = PyMem_Malloc((size_t)usable * sizeof(uint32_t));
    tok = direct ? (const uint32_t *)t.buf : own;
    fp = PyMem_Malloc((size_t)nb * 2 * sizeof(uint64_t));
    if (tok == NULL || fp == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    fa.k1 = k1;
    fa.k2 = k2;
    fa.p1 = self->p1;
    fa.p2 = self->p2;
    for (int l = 0; l < 4; l++) {
        fa.r1[l] = self->r1[l];
        fa.r2[l] = self->r2[l];
        fa.c1[l] = self->lane1[l] ^ (salted ? fmix64(salt ^ 0x5A17ULL) : 0);
        fa.c2[l] = self->lane2[l] ^ (salted ? fmix64(salt ^ 0xA5E1ULL) : 0);
    }
    fa.tpb = tpb;
    /* Is anything cached? Fingerprint the first checkpoint's tokens (or all, if fewer) first. */
    head_blocks = nb - 1 < CHECKPOINT ? nb : CHECKPOINT;
    head_tokens = head_blocks * tpb < usable ? head_blocks * tpb : usable;
    if (!direct && !fill_chunk(&t, 0, head_tokens, own))
        goto error;
    fingerprints(tok, head_tokens, &fa, fp);
    if (cache_find(self, fp[2 * (head_blocks - 1)], fp[2 * head_blocks - 1], (uint64_t)(head_blocks - 1)) == NULL) {
        /* A miss: hash directly. An int32 buffer is fingerprinted inside the v1 loop, for free
         * (v1_run_u32); a list's reads overlap the chain and keep the tokens for a fingerprint
         * pass. The fingerprints record this prompt. */
        if (direct && v1_fused_ok(tpb)) {
            v1_run_u32(tok, usable, tpb, salted, salt, 0, 0, out, &fa, fp);
        } else {
            if (!v1_run(&t, usable, tpb, salted, salt, 0, 0, out, own))
                goto error;
            fingerprints(tok, usable, &fa, fp);
        }
    } else {
        if (!direct && !fill_chunk(&t, head_tokens, usable - head_tokens, own + head_tokens))
            goto error;
        fingerprints(tok, usable, &fa, fp);
        /* a repeat: the last block is cached */
        if ((e = cache_find(self, fp[2 * (nb - 1)], fp[2 * nb - 1], (uint64_t)(nb - 1))) != NULL) {
            arena_copy_out(self, e->start, out, nb);
            self->full_hits++;
            self->blocks_reused += (unsigned long long)nb;
            goto done;
        }
        warm_tlb(self);
        prefetch_buckets(self, fp, nb);
        prefetch_record(self, nb);
        /* the deepest cached checkpoint strictly before the last block: at least the first */
        q_count = (nb - 1) / CHECKPOINT;
        lo = 0;
        hi = q_count;
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2, b = (mid + 1) * CHECKPOINT - 1;
            if (cache_find(self, fp[2 * b], fp[2 * b + 1], (uint64_t)b) != NULL) {
                best = mid;
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if (best >= 0) {
            Py_ssize_t b = (best + 1) * CHECKPOINT - 1;
            e = cache_find(self, fp[2 * b], fp[2 * b + 1], (uint64_t)b);
            reuse = b + 1;
            arena_copy_out(self, e->start, out, reuse);
        }
        memset(&view, 0, sizeof view);
        view.buf = (const char *)tok;
        view.itemsize = 4;
        view.n = usable;
        if (!v1_run(&view, usable, tpb, salted, salt, reuse, reuse > 0 ? out[reuse - 1] : 0, out, NULL))
            goto error;
    }
    self->blocks_reused += (unsigned long long)reuse;
    self->blocks_hashed += (unsigned long long)(nb - reuse);
    if ((uint64_t)nb <= self->arena_len) { /* record the whole prompt */
        start = arena_append(self, out, nb);
        for (Py_ssize_t b = CHECKPOINT - 1; b < nb - 1; b += CHECKPOINT)
            cache_put(self, fp[2 * b], fp[2 * b + 1], start, (uint64_t)b);
        cache_put(self, fp[2 * (nb - 1)], fp[2 * nb - 1], start, (uint64_t)(nb - 1));
    }
    goto done;
error:
    Py_CLEAR(result);
done:
fail:
    PyMem_Free(own);
    PyMem_Free(fp);
    if (opened)
        tokens_close(&t);
    return result;
}

/* clear(): forget every cached prefix. */
static PyObject *Cache_clear(PrefixHashCache *self, PyObject *unused)
{
    if (self->table != NULL)
        memset(self->table, 0, (self->table_mask + 1) * sizeof(Entry));
    self->head += self->arena_len; /* every record falls out of the ring */
    Py_RETURN_NONE;
}

static PyObject *Cache_get_stats(PrefixHashCache *self, void *closure)
{
    return Py_BuildValue("{sKsKsKsK}", "calls", self->calls, "full_hits", self->full_hits,
                         "blocks_reused", self->blocks_reused, "blocks_hashed", self->blocks_hashed);
}

static PyObject *Cache_get_tpb(PrefixHashCache *self, void *closure)
{
    return PyLong_FromSsize_t(self->tpb);
}

static PyMethodDef Cache_methods[] = {
    {"block_hashes", (PyCFunction)(void (*)(void))Cache_block_hashes, METH_FASTCALL | METH_KEYWORDS,
     "block_hashes(tokens, salt_id=None) -> bytes: v1 keys, u64 LE per block (cached by prefix)"},
    {"clear", (PyCFunction)(void (*)(void))Cache_clear, METH_NOARGS, "clear(): forget everything"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cache_getset[] = {
    {"stats", (getter)Cache_get_stats, NULL, "calls, full_hits, blocks_reused, blocks_hashed", NULL},
    {"tokens_per_block", (getter)Cache_get_tpb, NULL, "block size it hashes with", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PrefixHashCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmdisagg._native.PrefixHashCache",
    .tp_basicsize = sizeof(PrefixHashCache),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PrefixHashCache(tokens_per_block, max_blocks=2**21, seed=None): v1 block keys "
              "cached by prompt prefix (process-local).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Cache_init,
    .tp_dealloc = (destructor)Cache_dealloc,
    .tp_methods = Cache_methods,
    .tp_getset = Cache_getset,
};
