/*
 * SHA-256 (a portable transform and an Intel SHA-NI one, chosen at run time) and the v2 block
 * keys of TensorRT-LLM's KV cache manager V2.
 *
 * v2 (kv_cache_manager_v2 sequence_to_blockchain_keys, SHA-256 flavour): the root key is
 *   SHA-256(reuse scope bytes: a mask byte (bit 0 lora, bit 1 salt) + one u64 LE per present
 *   field), and each block's key is SHA-256(parent key || tokens as u32 LE) (token_bytes=8: u64
 *   LE, the layout of releases before the 4-byte TokenIdExt). The root is not emitted.
 *   v2_sha256_64 folds a key to its first 8 bytes read big-endian (truncate_sha256_hash_to_int64).
 * The GIL is kept; this path is not the default (v1_block_key is).
 */
#include "hash.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---- SHA-256 ---------------------------------------------------------------------------- */

typedef struct {
    uint32_t h[8];
    uint8_t buf[64];
    size_t nbuf;
    uint64_t total;
} Sha256;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H256[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_blocks_portable(uint32_t *h, const uint8_t *p, size_t nblocks)
{
    uint32_t w[64], a, b, c, d, e, f, g, hh, t1, t2;
    for (; nblocks > 0; nblocks--, p += 64) {
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
                   (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
        for (int i = 0; i < 64; i++) {
            t1 = hh + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
            t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
    }
}

#if defined(__x86_64__)
/* SHA-NI transform (Intel SHA extensions): two rounds per sha256rnds2 on the ABEF/CDGH state
 * halves, message schedule with sha256msg1/msg2. */
__attribute__((target("sha,sse4.1"))) static void sha256_blocks_shani(uint32_t *h, const uint8_t *p,
                                                                       size_t nblocks)
{
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&h[0]); /* DCBA */
    __m128i st1 = _mm_loadu_si128((const __m128i *)&h[4]); /* HGFE */
    __m128i st0, abef_save, cdgh_save, msg, m0, m1, m2, m3;
    tmp = _mm_shuffle_epi32(tmp, 0xB1);          /* CDAB */
    st1 = _mm_shuffle_epi32(st1, 0x1B);          /* EFGH */
    st0 = _mm_alignr_epi8(tmp, st1, 8);          /* ABEF */
    st1 = _mm_blend_epi16(st1, tmp, 0xF0);       /* CDGH */
    for (; nblocks > 0; nblocks--, p += 64) {
        abef_save = st0;
        cdgh_save = st1;
#define RNDS(mv, k)                                                                              \
    do {                                                                                         \
        msg = _mm_add_epi32((mv), _mm_loadu_si128((const __m128i *)&K256[k]));                   \
        st1 = _mm_sha256rnds2_epu32(st1, st0, msg);                                              \
        msg = _mm_shuffle_epi32(msg, 0x0E);                                                      \
        st0 = _mm_sha256rnds2_epu32(st0, st1, msg);                                              \
    } while (0)
        m0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 0)), bswap);
        m1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16)), bswap);
        m2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 32)), bswap);
        m3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 48)), bswap);
        RNDS(m0, 0);
        RNDS(m1, 4);
        m0 = _mm_sha256msg1_epu32(m0, m1);
        RNDS(m2, 8);
        m1 = _mm_sha256msg1_epu32(m1, m2);
        RNDS(m3, 12);
        for (int k = 16; k < 64; k += 16) {
            /* each step: w[t..t+3] = msg2(msg1(w[t-16..], w[t-12..]) + w[t-7..], w[t-4..]) */
            m0 = _mm_sha256msg2_epu32(_mm_add_epi32(m0, _mm_alignr_epi8(m3, m2, 4)), m3);
            RNDS(m0, k);
            m2 = _mm_sha256msg1_epu32(m2, m3);
            m1 = _mm_sha256msg2_epu32(_mm_add_epi32(m1, _mm_alignr_epi8(m0, m3, 4)), m0);
            RNDS(m1, k + 4);
            m3 = _mm_sha256msg1_epu32(m3, m0);
            m2 = _mm_sha256msg2_epu32(_mm_add_epi32(m2, _mm_alignr_epi8(m1, m0, 4)), m1);
            RNDS(m2, k + 8);
            m0 = _mm_sha256msg1_epu32(m0, m1);
            m3 = _mm_sha256msg2_epu32(_mm_add_epi32(m3, _mm_alignr_epi8(m2, m1, 4)), m2);
            RNDS(m3, k + 12);
            m1 = _mm_sha256msg1_epu32(m1, m2);
        }
#undef RNDS
        st0 = _mm_add_epi32(st0, abef_save);
        st1 = _mm_add_epi32(st1, cdgh_save);
    }
    tmp = _mm_shuffle_epi32(st0, 0x1B);    /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xB1);    /* DCHG */
    st0 = _mm_blend_epi16(tmp, st1, 0xF0); /* DCBA */
    st1 = _mm_alignr_epi8(st1, tmp, 8);    /* HGFE */
    _mm_storeu_si128((__m128i *)&h[0], st0);
    _mm_storeu_si128((__m128i *)&h[4], st1);
}
#endif

typedef void (*sha_blocks_fn)(uint32_t *, const uint8_t *, size_t);
static sha_blocks_fn sha_blocks = NULL;
static int sha_forced_portable = 0;

static sha_blocks_fn sha_select(void)
{
    if (sha_blocks == NULL) {
        sha_blocks = sha256_blocks_portable;
#if defined(__x86_64__)
        __builtin_cpu_init();
        if (!sha_forced_portable && __builtin_cpu_supports("sha") &&
            __builtin_cpu_supports("sse4.1"))
            sha_blocks = sha256_blocks_shani;
#endif
    }
    return sha_blocks;
}

static void sha256_init(Sha256 *s)
{
    memcpy(s->h, H256, sizeof H256);
    s->nbuf = 0;
    s->total = 0;
}

static void sha256_update(Sha256 *s, const uint8_t *p, size_t n)
{
    sha_blocks_fn fn = sha_select();
    s->total += n;
    if (s->nbuf > 0) {
        size_t take = 64 - s->nbuf < n ? 64 - s->nbuf : n;
        memcpy(s->buf + s->nbuf, p, take);
        s->nbuf += take;
        p += take;
        n -= take;
        if (s->nbuf == 64) {
            fn(s->h, s->buf, 1);
            s->nbuf = 0;
        }
    }
    if (n >= 64) {
        fn(s->h, p, n / 64);
        p += n & ~(size_t)63;
        n &= 63;
    }
    if (n > 0) {
        memcpy(s->buf, p, n);
        s->nbuf = n;
    }
}

static void sha256_final(Sha256 *s, uint8_t out[32])
{
    uint64_t bits = s->total * 8;
    uint8_t pad[72];
    size_t npad = (s->nbuf < 56 ? 56 : 120) - s->nbuf;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (int i = 0; i < 8; i++)
        pad[npad + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(s, pad, npad + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

/* _sha256_impl(force=None) -> name of the transform in use; force=True selects the portable one
 * (tests), False the fastest one again. */
PyObject *mod_sha256_impl(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int force;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "_sha256_impl() takes at most 1 argument");
        goto fail;
    }
    if (nargs == 1 && args[0] != Py_None) {
        if ((force = PyObject_IsTrue(args[0])) < 0)
            goto fail;
        sha_forced_portable = force;
        sha_blocks = NULL;
    }
    result = PyUnicode_FromString(sha_select() == sha256_blocks_portable ? "portable" : "shani");
fail:
    return result;
}

/* ---- v2 (SHA-256 block chain) ----------------------------------------------------------- */

/* Keys of every block into out[nblocks * 32]. 0 with an exception set (bad token). */
static int v2_run(HashArgs *a, uint8_t *out)
{
    uint8_t scope[17], key[32], enc[TOKEN_CHUNK * 8];
    uint64_t vals[TOKEN_CHUNK];
    size_t ns = 1;
    Sha256 s;
    scope[0] = (uint8_t)((a->lora ? 1 : 0) | (a->salted ? 2 : 0));
    if (a->lora) {
        memcpy(scope + ns, &a->lora_id, 8);
        ns += 8;
    }
    if (a->salted) {
        memcpy(scope + ns, &a->salt, 8);
        ns += 8;
    }
    sha256_init(&s);
    sha256_update(&s, scope, ns);
    sha256_final(&s, key);
    for (Py_ssize_t b = 0; b < a->nblocks; b++) {
        Py_ssize_t start = b * a->tpb, end = start + a->tpb < a->usable ? start + a->tpb : a->usable;
        sha256_init(&s);
        sha256_update(&s, key, 32);
        while (start < end) {
            Py_ssize_t cnt = end - start < TOKEN_CHUNK ? end - start : TOKEN_CHUNK;
            if (!tokens_read(&a->tok, start, cnt, vals))
                return 0;
            for (Py_ssize_t i = 0; i < cnt; i++) {
                if (a->token_bytes == 4 && vals[i] >> 32 != 0) {
                    PyErr_SetString(PyExc_ValueError, "v2 token ids must be in 0..2**32-1");
                    return 0;
                }
                memcpy(enc + i * a->token_bytes, &vals[i], (size_t)a->token_bytes);
            }
            sha256_update(&s, enc, (size_t)(cnt * a->token_bytes));
            start += cnt;
        }
        sha256_final(&s, key);
        memcpy(out + 32 * b, key, 32);
    }
    return 1;
}

static PyObject *v2_common(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int fold)
{
    PyObject *result = NULL;
    uint8_t *keys = NULL;
    uint64_t *out;
    HashArgs a;
    if (!hash_args(fold ? "block_hashes_v2_64" : "block_hashes_v2", args, nargs, kwnames, 1, &a))
        goto fail;
    if (!fold) {
        result = PyBytes_FromStringAndSize(NULL, a.nblocks * 32);
        if (result != NULL && !v2_run(&a, (uint8_t *)PyBytes_AS_STRING(result)))
            Py_CLEAR(result);
    } else if ((keys = PyMem_Malloc((size_t)a.nblocks * 32 + 1)) == NULL) {
        PyErr_NoMemory();
    } else if (v2_run(&a, keys) && (result = PyBytes_FromStringAndSize(NULL, a.nblocks * 8))) {
        out = (uint64_t *)PyBytes_AS_STRING(result);
        for (Py_ssize_t b = 0; b < a.nblocks; b++) {
            uint64_t v = 0;
            for (int i = 0; i < 8; i++)
                v = v << 8 | keys[32 * b + i];
            out[b] = v;
        }
    }
    PyMem_Free(keys);
    tokens_close(&a.tok);
fail:
    return result;
}

PyObject *mod_block_hashes_v2(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    return v2_common(args, nargs, kwnames, 0);
}

PyObject *mod_block_hashes_v2_64(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    return v2_common(args, nargs, kwnames, 1);
}
