/*
 * KV-cache block hashes of a prompt, computed exactly as TensorRT-LLM's executors key their
 * blocks (shmdisagg/hashing.py holds the pure-Python references the tests compare against).
 *
 * Block boundaries (both algorithms): the prompt's last token is excluded, blocks are
 * tokens[t : min(t + tpb, len - 1)] for t = 0, tpb, 2 tpb, ..., and a final partial block is kept.
 *
 * v1_block_key (tensorrt_llm/runtime/kv_cache_hash.py, C++ BlockKeyHasher): per block,
 *   seed = len ^ (parent * 0xBF58476D1CE4E5B9); if parent == 0 and a salt: seed = mix64(salt, seed);
 *   per token: seed ^= premix(token) + (seed << 6) + (seed >> 2)   (u64; premix is u32 math)
 * premix() depends only on the token, so it runs ahead of the serial chain: the loops below are
 * bound by the chain's four dependent ALU ops per token (4.1 cycles, native/README.md). int32
 * buffers with a block size that is a multiple of 8 take one AVX2 loop that premixes
 * (and for the prefix cache fingerprints) the next 8 tokens in the chain's shadow (v1_run_u32):
 * the bare chain's cost; lists and other buffers premix a chunk of 256 ahead (v1_run).
 *
 * Tokens: a list of ints (compact ints are read straight from the objects) or any buffer of
 * 4- or 8-byte integers (array, numpy, memoryview). The GIL is kept: 32k tokens take tens of
 * microseconds, less than the cost of handing them to another thread.
 */
#include "hash.h"


/* ---- tokens ----------------------------------------------------------------------------- */

int tokens_open(PyObject *o, Tokens *t)
{
    int ok = 0;
    const char *fmt;
    char code;
    memset(t, 0, sizeof *t);
    if (PyList_Check(o)) {
        t->items = ((PyListObject *)o)->ob_item;
        t->n = PyList_GET_SIZE(o);
        ok = 1;
    } else if (PyObject_GetBuffer(o, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        t->has_view = 1;
        fmt = t->view.format ? t->view.format : "B";
        if (*fmt == '<' || *fmt == '=' || *fmt == '@')
            fmt++;
        code = fmt[0];
        if (fmt[0] == 0 || fmt[1] != 0 || strchr("iIlLqQ", code) == NULL ||
            (t->view.itemsize != 4 && t->view.itemsize != 8)) {
            PyErr_Format(PyExc_TypeError, "tokens buffer must hold 4- or 8-byte integers, not "
                         "format %s", t->view.format ? t->view.format : "B");
        } else {
            t->buf = t->view.buf;
            t->itemsize = t->view.itemsize;
            t->is_signed = code == 'i' || code == 'l' || code == 'q';
            t->n = t->view.len / t->itemsize;
            ok = 1;
        }
    } else {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "tokens must be a list of ints or a buffer of int32/int64, "
                     "not %.100s", Py_TYPE(o)->tp_name);
    }
    if (!ok && t->has_view) {
        PyBuffer_Release(&t->view);
        t->has_view = 0;
    }
    return ok;
}

void tokens_close(Tokens *t)
{
    if (t->has_view)
        PyBuffer_Release(&t->view);
    t->has_view = 0;
}

/* Low 64 bits (two's complement) of a Python int; compact ints without a call. 0 + TypeError
 * for a non-int. */
static inline int long_bits(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "token ids must be ints, not %.100s", Py_TYPE(o)->tp_name);
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *out = (uint64_t)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    }
#else
    {
        Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        if (size == 0 || size == 1 || size == -1) {
            uint64_t v = size == 0 ? 0 : d[0];
            *out = size < 0 ? (uint64_t)0 - v : v;
            return 1;
        }
    }
#endif
    *out = PyLong_AsUnsignedLongLongMask(o);
    return !(*out == (uint64_t)-1 && PyErr_Occurred());
}

/* tokens[start .. start + count) as u64 (two's complement bits); 0 with an exception set. */
int tokens_read(const Tokens *t, Py_ssize_t start, Py_ssize_t count, uint64_t *out)
{
    if (t->items != NULL) {
        for (Py_ssize_t i = 0; i < count; i++)
            if (!long_bits(t->items[start + i], &out[i]))
                return 0;
    } else if (t->itemsize == 4) {
        const char *p = t->buf + start * 4;
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t v;
            memcpy(&v, p + 4 * i, 4);
            out[i] = t->is_signed ? (uint64_t)(int64_t)(int32_t)v : v;
        }
    } else {
        memcpy(out, t->buf + start * 8, (size_t)count * 8);
    }
    return 1;
}

/* ---- v1_block_key ----------------------------------------------------------------------- */

#define HASH32 0x45D9F3Bu
#define HASH64_1 0xBF58476D1CE4E5B9ULL
#define HASH64_2 0x94D049BB133111EBULL
#define COMBINE 0x9E3779B9u
#define PARENT_MUL 0xBF58476D1CE4E5B9ULL

static inline uint64_t premix(uint64_t token)
{
    uint32_t v = (uint32_t)token;
    v = ((v >> 16) ^ v) * HASH32;
    v = ((v >> 16) ^ v) * HASH32;
    v = (v >> 16) ^ v;
    return (uint32_t)(v + COMBINE); /* wraps in u32 before the u64 terms, as in C++ */
}

static inline uint64_t mix64(uint64_t v, uint64_t seed)
{
    v = (v ^ (v >> 30)) * HASH64_1;
    v = (v ^ (v >> 27)) * HASH64_2;
    v ^= v >> 31;
    return seed ^ (v + COMBINE + (seed << 6) + (seed >> 2));
}

static inline uint64_t v1_seed(uint64_t len, uint64_t parent, int salted, uint64_t salt)
{
    uint64_t seed = len ^ (parent * PARENT_MUL);
    if (parent == 0 && salted)
        seed = mix64(salt, seed);
    return seed;
}

/* One step of the serial chain: four dependent ALU ops, the bound of the whole function. On
 * x86-64 the shifts become LEA forms that need no register copy (5 -> 4.2 cycles a token). */
static inline uint64_t chain_step(uint64_t seed, uint64_t v)
{
#if defined(__x86_64__)
    uint64_t a, b;
    __asm__("lea (,%[s],8), %[a]\n\t"     /* a = seed << 3 */
            "mov %[s], %[b]\n\t"
            "shr $2, %[b]\n\t"
            "add %[v], %[b]\n\t"          /* b = v + (seed >> 2) */
            "lea (%[b],%[a],8), %[a]\n\t" /* a = b + (seed << 6) */
            "xor %[a], %[s]"
            : [s] "+r"(seed), [a] "=&r"(a), [b] "=&r"(b)
            : [v] "r"(v));
    return seed;
#else
    return seed ^ (v + (seed << 6) + (seed >> 2));
#endif
}

/* premix over a chunk in place; the AVX2 clone does 8 tokens per instruction. */
static void premix_scalar(uint32_t *v, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        v[i] = (uint32_t)premix(v[i]);
}

#if defined(__x86_64__)
__attribute__((target("avx2"), optimize("O3"))) static void premix_avx2(uint32_t *v, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x = v[i];
        x = ((x >> 16) ^ x) * HASH32;
        x = ((x >> 16) ^ x) * HASH32;
        x = (x >> 16) ^ x;
        v[i] = x + COMBINE;
    }
}
#endif

static void (*premix_chunk)(uint32_t *, Py_ssize_t) = NULL;

static void premix_select(void)
{
    premix_chunk = premix_scalar;
#if defined(__x86_64__)
    if (v1_avx2())
        premix_chunk = premix_avx2;
#endif
}

/* Token bits of one list item: exact compact ints are read from the object itself. */
#if PY_VERSION_HEX >= 0x030C0000
#define LIST_FAST(o, out)                                                                        \
    (Py_IS_TYPE((o), &PyLong_Type) && PyUnstable_Long_IsCompact((PyLongObject *)(o)) &&          \
     ((out) = (uint64_t)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)(o)), 1))
#else
#define LIST_FAST(o, out)                                                                        \
    (Py_IS_TYPE((o), &PyLong_Type) && Py_SIZE(o) == 1 &&                                         \
     ((out) = ((PyLongObject *)(o))->ob_digit[0], 1))
#endif

#if PY_VERSION_HEX < 0x030C0000
/* Eight list items at once: if all are positive single-digit exact ints (every token id below
 * 2**30), writes their values to out (unless NULL) and returns 1; else 0. The check ORs the
 * items' type and size words into one word (no flag registers: setcc chains of partial-register
 * writes made the old four-item version a serial dependency, ~4.5 cycles an item); the digits
 * are read only once all eight are known to be ints. */
static inline __attribute__((always_inline)) int eight_small_ints(PyObject *const *p, uint32_t *out)
{
    const uintptr_t want = (uintptr_t)&PyLong_Type;
#define BAD(k) (((uintptr_t)Py_TYPE(p[k]) ^ want) | ((uintptr_t)Py_SIZE(p[k]) ^ 1))
    if ((((BAD(0) | BAD(1)) | (BAD(2) | BAD(3))) | ((BAD(4) | BAD(5)) | (BAD(6) | BAD(7)))) != 0)
        return 0; /* a tree of ORs: no serial chain through the eight items */
#undef BAD
    if (out != NULL)
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            out[k] = ((PyLongObject *)p[k])->ob_digit[0];
    return 1;
}
#endif

#define V1_CHUNK 256 /* tokens premixed ahead of the chain: 1 KiB, stays in L1 */

/* Raw token bits of tokens[start .. start + n) into out (u32). 0 with an exception set. */
int fill_chunk(const Tokens *t, Py_ssize_t start, Py_ssize_t n, uint32_t *out)
{
    uint64_t raw;
    Py_ssize_t i = 0;
    if (t->items != NULL) {
        PyObject *const *it = t->items + start;
        while (i < n) {
#if PY_VERSION_HEX < 0x030C0000
            while (i + 8 <= n && eight_small_ints(it + i, out + i))
                i += 8;
#endif
            for (Py_ssize_t stop = i + 8 < n ? i + 8 : n; i < stop; i++) {
                PyObject *o = it[i];
                if (!LIST_FAST(o, raw) && !long_bits(o, &raw))
                    return 0;
                out[i] = (uint32_t)raw;
            }
        }
    } else if (t->itemsize == 4) { /* signed or not, the low 32 bits are the token's */
        memcpy(out, t->buf + 4 * start, (size_t)n * 4);
    } else {
        for (; i < n; i++) {
            uint64_t v;
            memcpy(&v, t->buf + 8 * (start + i), 8);
            out[i] = (uint32_t)v;
        }
    }
    return 1;
}

/* Chained v1 keys (see hash.h). The tokens are premixed a chunk ahead of the chain; for a
 * list, reading chunk k + 1's ints is interleaved with chaining chunk k, so those loads and type
 * checks fill the issue slots the serial chain leaves idle. */
int v1_run(const Tokens *t, Py_ssize_t usable, Py_ssize_t tpb, int salted, uint64_t salt,
           Py_ssize_t first_block, uint64_t parent, uint64_t *out, uint32_t *capture)
{
    uint32_t bufs[2][V1_CHUNK], *cur = bufs[0], *nxt = bufs[1], *sw;
    uint64_t seed, raw;
    Py_ssize_t pos = first_block * tpb, block_end, nb = first_block, cnt, ncnt, i, stop, len;
    int ok = 1;
    if (pos >= usable)
        return 1;
    if (t->items == NULL && t->itemsize == 4 && capture == NULL && v1_fused_ok(tpb)) {
        v1_run_u32((const uint32_t *)t->buf, usable, tpb, salted, salt, first_block, parent, out, NULL, NULL);
        return 1;
    }
    if (premix_chunk == NULL)
        premix_select();
    block_end = pos + tpb < usable ? pos + tpb : usable;
    seed = v1_seed((uint64_t)(block_end - pos), parent, salted, salt);
    cnt = usable - pos < V1_CHUNK ? usable - pos : V1_CHUNK;
    if (!fill_chunk(t, pos, cnt, cur))
        return 0;
    if (capture != NULL)
        memcpy(capture + pos, cur, (size_t)cnt * 4);
    premix_chunk(cur, cnt);
    while (pos < usable) {
        Py_ssize_t npos = pos + cnt;
        ncnt = usable - npos < V1_CHUNK ? usable - npos : V1_CHUNK;
        int interleave = t->items != NULL;
        if (!interleave && ncnt > 0 && !fill_chunk(t, npos, ncnt, nxt))
            return 0;
        i = 0;
        while (i < cnt) {
            stop = block_end - pos < cnt ? block_end - pos : cnt;
            if (interleave) {
                for (; i < stop; i++) {
                    seed = chain_step(seed, cur[i]);
                    if (i < ncnt) {
                        PyObject *o = t->items[npos + i];
                        if (!LIST_FAST(o, raw) && !(ok = long_bits(o, &raw)))
                            return 0;
                        nxt[i] = (uint32_t)raw;
                    }
                }
            } else {
                for (; i < stop; i++)
                    seed = chain_step(seed, cur[i]);
            }
            if (pos + i == block_end) {
                out[nb++] = parent = seed;
                len = usable - block_end < tpb ? usable - block_end : tpb;
                block_end += len;
                seed = v1_seed((uint64_t)len, parent, salted, salt);
            }
        }
        if (interleave && ncnt > cnt && !fill_chunk(t, npos + cnt, ncnt - cnt, nxt + cnt))
            return 0; /* only when a chunk is longer than the one before: never, kept for safety */
        if (ncnt > 0) {
            if (capture != NULL)
                memcpy(capture + npos, nxt, (size_t)ncnt * 4);
            premix_chunk(nxt, ncnt);
        }
        sw = cur, cur = nxt, nxt = sw;
        pos = npos;
        cnt = ncnt;
    }
    return ok;
}

/* ---- v1 of u32 tokens in one loop: premix, NH fingerprints and the chain ------------------- */

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2"))) static inline __m256i premix8(__m256i x)
{
    const __m256i h = _mm256_set1_epi32((int)HASH32), c = _mm256_set1_epi32((int)COMBINE);
    x = _mm256_mullo_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), h);
    x = _mm256_mullo_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), h);
    x = _mm256_xor_si256(_mm256_srli_epi32(x, 16), x);
    return _mm256_add_epi32(x, c);
}

/* The whole blocks go by groups of 8 tokens (tpb is a multiple of 8): each step first does the
 * vector work of the next group (premix into a two-group ring, NH lane sums, the lane chains when
 * the vector side crosses into the next block, a fingerprint where the cache reads one), then
 * chains this group's 8 premixed tokens. The chain is the loop's critical path (four dependent ALU
 * ops a token); the vector work runs on the other ports in its shadow, so premix and fingerprints
 * cost no time: 32k tokens chain in ~41.7 us on the development VM, as the bare chain does,
 * against ~45 us for a premix pass then the chain, plus ~7 us for a separate fingerprint pass
 * (BENCHMARKS.md). A last partial block is chained and fingerprinted in scalar code. */
__attribute__((target("avx2"))) static void v1_run_u32_avx2(const uint32_t *tok, Py_ssize_t usable,
                                                             Py_ssize_t tpb, int salted, uint64_t salt,
                                                             Py_ssize_t first_block, uint64_t parent,
                                                             uint64_t *out, const FpArgs *fa, uint64_t *fp)
{
    uint32_t ring[2][8] __attribute__((aligned(32)));
    uint64_t c1[4], c2[4], s1[4], s2[4];
    Py_ssize_t start = first_block * tpb, last = (usable - 1) / tpb * tpb, whole_end, groups, per_block;
    Py_ssize_t nb = first_block, nbv = first_block, nblocks = (usable + tpb - 1) / tpb, g, len, i;
    uint64_t seed;
    __m256i v1 = _mm256_setzero_si256(), v2 = _mm256_setzero_si256(), x, C1, C2, P1, P2, T1, T2;
    if (start >= usable)
        return;
    whole_end = usable - last == tpb ? usable : last; /* blocks before whole_end have tpb tokens */
    groups = (whole_end - start) / 8;
    per_block = tpb / 8;
    if (fa != NULL) {
        C1 = _mm256_loadu_si256((const __m256i *)fa->c1);
        C2 = _mm256_loadu_si256((const __m256i *)fa->c2);
        P1 = _mm256_set1_epi64x((long long)fa->p1);
        P2 = _mm256_set1_epi64x((long long)fa->p2);
        T1 = _mm256_set_epi64x(0, 0, 0, (long long)((uint64_t)tpb << 48));
        T2 = _mm256_set_epi64x(0, 0, 0, (long long)((uint64_t)tpb << 40));
    } else {
        C1 = C2 = P1 = P2 = T1 = T2 = _mm256_setzero_si256();
    }
    if (groups > 0) {
        x = _mm256_loadu_si256((const __m256i *)(tok + start));
        if (fa != NULL) {
            v1 = nh8(x, fa->k1, v1);
            v2 = nh8(x, fa->k2, v2);
        }
        _mm256_store_si256((__m256i *)ring[0], premix8(x));
        seed = v1_seed((uint64_t)tpb, parent, salted, salt);
        for (g = 0; g < groups; g++) {
            const uint32_t *v = ring[g & 1];
            Py_ssize_t h = g + 1;
            if (h < groups) {
                Py_ssize_t j = h % per_block * 8;
                x = _mm256_loadu_si256((const __m256i *)(tok + start + 8 * h));
                if (fa != NULL) {
                    if (j == 0) { /* the vector side enters the next block: chain this one */
                        lanes_step8(&C1, &C2, P1, P2, v1, v2, T1, T2);
                        if (fp_wanted(nbv, nblocks)) {
                            _mm256_storeu_si256((__m256i *)c1, C1);
                            _mm256_storeu_si256((__m256i *)c2, C2);
                            lanes_fold(c1, c2, fa, fp, nbv);
                        }
                        nbv++;
                        v1 = v2 = _mm256_setzero_si256();
                    }
                    v1 = nh8(x, fa->k1 + j, v1);
                    v2 = nh8(x, fa->k2 + j, v2);
                }
                _mm256_store_si256((__m256i *)ring[h & 1], premix8(x));
            }
            seed = chain_step(seed, v[0]);
            seed = chain_step(seed, v[1]);
            seed = chain_step(seed, v[2]);
            seed = chain_step(seed, v[3]);
            seed = chain_step(seed, v[4]);
            seed = chain_step(seed, v[5]);
            seed = chain_step(seed, v[6]);
            seed = chain_step(seed, v[7]);
            if (h % per_block == 0) {
                out[nb++] = parent = seed;
                seed = v1_seed((uint64_t)tpb, parent, salted, salt);
            }
        }
        if (fa != NULL) {
            lanes_step8(&C1, &C2, P1, P2, v1, v2, T1, T2);
            _mm256_storeu_si256((__m256i *)c1, C1);
            _mm256_storeu_si256((__m256i *)c2, C2);
            if (fp_wanted(nbv, nblocks))
                lanes_fold(c1, c2, fa, fp, nbv);
            nbv++;
        }
    } else if (fa != NULL) {
        memcpy(c1, fa->c1, sizeof c1);
        memcpy(c2, fa->c2, sizeof c2);
    }
    if (whole_end < usable) { /* the last block, shorter than tpb */
        uint32_t t[8];
        len = usable - whole_end;
        seed = v1_seed((uint64_t)len, parent, salted, salt);
        memset(s1, 0, sizeof s1);
        memset(s2, 0, sizeof s2);
        for (i = 0; i < len; i += 8) {
            Py_ssize_t n = len - i < 8 ? len - i : 8;
            memcpy(t, (const char *)(tok + whole_end + i), (size_t)n * 4);
            if (fa != NULL) /* pairs continue their lanes: i is a multiple of 8 */
                nh_lanes(t, 0, n, fa->k1 + i, fa->k2 + i, s1, s2);
            for (Py_ssize_t k = 0; k < n; k++)
                seed = chain_step(seed, premix(t[k]));
        }
        out[nb] = seed;
        if (fa != NULL) {
            lanes_step(c1, c2, fa, s1, s2, len);
            lanes_fold(c1, c2, fa, fp, nbv);
        }
    }
}
#endif

static int have_avx2 = -1, forced_portable = 0;

int v1_avx2(void)
{
#if defined(__x86_64__)
    if (have_avx2 < 0) {
        __builtin_cpu_init();
        have_avx2 = __builtin_cpu_supports("avx2") != 0;
    }
    return have_avx2 && !forced_portable;
#else
    return 0;
#endif
}

int v1_fused_ok(Py_ssize_t tpb) { return v1_avx2() && tpb % 8 == 0; }

/* _v1_impl(force_portable=None) -> "avx2" | "portable": the v1 premix, the one-loop path and the
 * prefix cache's fingerprints in use; True forces the portable code (tests: both must give the
 * same keys and fingerprints), False the fastest again. */
PyObject *mod_v1_impl(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    int force;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "_v1_impl() takes at most 1 argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        if ((force = PyObject_IsTrue(args[0])) < 0)
            return NULL;
        forced_portable = force;
        premix_chunk = NULL;
    }
    return PyUnicode_FromString(v1_avx2() ? "avx2" : "portable");
}

void v1_run_u32(const uint32_t *tok, Py_ssize_t usable, Py_ssize_t tpb, int salted, uint64_t salt,
                Py_ssize_t first_block, uint64_t parent, uint64_t *out, const FpArgs *fa, uint64_t *fp)
{
#if defined(__x86_64__)
    v1_run_u32_avx2(tok, usable, tpb, salted, salt, first_block, parent, out, fa, fp);
#endif
}

int opt_u64(PyObject *o, const char *what, int *present, uint64_t *out)
{
    *present = o != NULL && o != Py_None;
    if (!*present)
        return 1;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int or None", what);
        return 0;
    }
    *out = PyLong_AsUnsignedLongLong(o);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s must be in 0..2**64-1", what);
        return 0;
    }
    return 1;
}

int hash_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                     int v2, HashArgs *a)
{
    static const char *const names[] = {"tokens", "tokens_per_block", "salt_id", "lora_id",
                                        "token_bytes"};
    PyObject *vals[5] = {NULL, NULL, NULL, NULL, NULL};
    Py_ssize_t nmax = v2 ? 5 : 3, nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int64_t tpb, tb = 4;
    memset(a, 0, sizeof *a);
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments", fn, nmax);
        return 0;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        vals[i] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t j = 0;
        while (j < nmax && PyUnicode_CompareWithASCIIString(key, names[j]) != 0)
            j++;
        if (j == nmax || vals[j] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected or repeated argument %R", fn, key);
            return 0;
        }
        vals[j] = args[nargs + k];
    }
    if (vals[0] == NULL || vals[1] == NULL) {
        PyErr_Format(PyExc_TypeError, "%s() needs tokens and tokens_per_block", fn);
        return 0;
    }
    if (!arg_range(vals[1], 1, 1 << 20, "tokens_per_block", &tpb) ||
        !opt_u64(vals[2], "salt_id", &a->salted, &a->salt) ||
        !opt_u64(vals[3], "lora_id", &a->lora, &a->lora_id) ||
        (vals[4] != NULL && !arg_range(vals[4], 4, 8, "token_bytes", &tb)))
        return 0;
    if (tb != 4 && tb != 8) {
        PyErr_SetString(PyExc_ValueError, "token_bytes must be 4 or 8");
        return 0;
    }
    if (!tokens_open(vals[0], &a->tok))
        return 0;
    a->tpb = (Py_ssize_t)tpb;
    a->token_bytes = (int)tb;
    a->usable = a->tok.n > 0 ? a->tok.n - 1 : 0;
    a->nblocks = (a->usable + a->tpb - 1) / a->tpb;
    return 1;
}

/* block_hashes_v1(tokens, tokens_per_block, salt_id=None) -> bytes (u64 LE per block) */
PyObject *mod_block_hashes_v1(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    PyObject *result = NULL;
    HashArgs a;
    if (!hash_args("block_hashes_v1", args, nargs, kwnames, 0, &a))
        goto fail;
    result = PyBytes_FromStringAndSize(NULL, a.nblocks * 8);
    if (result != NULL && a.nblocks > 0 &&
        !v1_run(&a.tok, a.usable, a.tpb, a.salted, a.salt, 0, 0, (uint64_t *)PyBytes_AS_STRING(result),
                NULL))
        Py_CLEAR(result);
    tokens_close(&a.tok);
fail:
    return result;
}

/* ---- token-id prompts ------------------------------------------------------------------- */

/* Token ids of a validated prompt: items[0..n) must be exact ints in [0, 2**31). Writes their
 * values to out (unless NULL) and returns 1, or returns 0 at the first item that is not one.
 * The hot path's check of every token-id prompt: 32k fresh ints from orjson in about 35 us. */
static int ids_u31(PyObject *const *items, Py_ssize_t n, uint32_t *out)
{
    Py_ssize_t i = 0, stop;
    while (i < n) {
#if PY_VERSION_HEX < 0x030C0000
        while (i + 8 <= n && eight_small_ints(items + i, out != NULL ? out + i : NULL))
            i += 8;
#endif
        /* item by item up to the next group of eight (a 0, a value >= 2**30, or the end) */
        for (stop = i + 8 < n ? i + 8 : n; i < stop; i++) {
            PyObject *o = items[i];
            long v;
            int overflow = 0;
            if (!PyLong_CheckExact(o))
                return 0;
#if PY_VERSION_HEX >= 0x030C0000
            if (PyUnstable_Long_IsCompact((PyLongObject *)o))
                v = (long)PyUnstable_Long_CompactValue((PyLongObject *)o);
            else
#endif
                v = PyLong_AsLongAndOverflow(o, &overflow); /* exact int: no Python code runs */
            if (overflow || v < 0 || v >= (1L << 31))
                return 0;
            if (out != NULL)
                out[i] = (uint32_t)v;
        }
    }
    return 1;
}

/* token_ids_ok(obj) -> bool: obj is a non-empty list of exact ints in [0, 2**31). */
PyObject *mod_token_ids_ok(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "token_ids_ok(obj) takes one argument");
        return NULL;
    }
    PyObject *obj = args[0];
    if (!PyList_CheckExact(obj) || PyList_GET_SIZE(obj) == 0 ||
        !ids_u31(((PyListObject *)obj)->ob_item, PyList_GET_SIZE(obj), NULL))
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* token_ids_int32(obj) -> bytes | None: the ids of a token-id prompt (a non-empty list of exact
 * ints in [0, 2**31)) as native-order int32, in the same pass that checks them; None otherwise.
 * The fleet's hot path hashes from these bytes (cast to an 'i' memoryview) instead of the list. */
PyObject *mod_token_ids_int32(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *obj, *out;
    Py_ssize_t n;
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "token_ids_int32(obj) takes one argument");
        return NULL;
    }
    obj = args[0];
    if (!PyList_CheckExact(obj) || (n = PyList_GET_SIZE(obj)) == 0)
        Py_RETURN_NONE;
    if ((out = PyBytes_FromStringAndSize(NULL, n * 4)) == NULL)
        return NULL;
    if (!ids_u31(((PyListObject *)obj)->ob_item, n, (uint32_t *)PyBytes_AS_STRING(out))) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}
