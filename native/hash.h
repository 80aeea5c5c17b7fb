/*
 * Shared declarations of the block-hash translation units: hash.c (token reading, v1_block_key,
 * argument parsing), sha256.c (SHA-256, the v2 keys) and hashcache.c (the prefix hash cache).
 */
#ifndef SHMDISAGG_HASH_H
#define SHMDISAGG_HASH_H

#include "_native.h"

/* A prompt's token ids: a list's items, or a buffer of 4- or 8-byte integers. */
typedef struct {
    PyObject **items; /* list items, or NULL for a buffer */
    const char *buf;
    Py_ssize_t itemsize; /* 4 or 8 for a buffer */
    int is_signed;
    Py_ssize_t n;
    Py_buffer view;
    int has_view;
} Tokens;

SD_HIDDEN int tokens_open(PyObject *o, Tokens *t);
SD_HIDDEN void tokens_close(Tokens *t);
/* tokens[start .. start + count) as u64 (two's complement bits); 0 with an exception set. */
SD_HIDDEN int tokens_read(const Tokens *t, Py_ssize_t start, Py_ssize_t count, uint64_t *out);
/* The low 32 bits of tokens[start .. start + n) (what v1 hashes); 0 with an exception set. */
SD_HIDDEN int fill_chunk(const Tokens *t, Py_ssize_t start, Py_ssize_t n, uint32_t *out);

/* Chained v1 keys of blocks first_block.. of the first `usable` tokens into out[first_block..],
 * chained on `parent` (the key of block first_block - 1; 0 at the root). `capture` (or NULL)
 * receives the low 32 bits of every token read, at its index. 0 with an exception set. */
SD_HIDDEN int v1_run(const Tokens *t, Py_ssize_t usable, Py_ssize_t tpb, int salted, uint64_t salt,
                     Py_ssize_t first_block, uint64_t parent, uint64_t *out, uint32_t *capture);

/* The prefix cache's block fingerprints (hashcache.c), per key set (k1, k2: tpb + 2 NH keys each):
 * a block's NH sum is kept as four lane sums (the token pairs 0, 4, 8.. in lane 0, pairs 1, 5, 9..
 * in lane 1, and so on: what one AVX2 step of eight tokens leaves in its four 64-bit lanes), each
 * lane folded into its own polynomial chain c = c * P + s (P odd, below 2**32), and the four
 * chains are combined into one 64-bit fingerprint sum(c[l] * R[l]) (R odd) only where the cache
 * looks: at every CHECKPOINT-th block and the last one. No horizontal sum per block: ~0.13 ns a
 * token against ~0.21 for one scalar chain per key. Salted prompts start their chains elsewhere. */
#define CHECKPOINT 16 /* blocks between the prefix cache's checkpoints */
typedef struct {
    const uint32_t *k1, *k2;
    uint64_t p1, p2;       /* odd, below 2**32 */
    uint64_t r1[4], r2[4]; /* odd: the combination of the lanes */
    uint64_t c1[4], c2[4]; /* the lane chains before block 0 */
    Py_ssize_t tpb;
} FpArgs;

/* NH lane sums of t[i0, len) (i0 even: a pair boundary) added to s1/s2; an odd last token pairs
 * with its key. */
static inline void nh_lanes(const uint32_t *t, Py_ssize_t i0, Py_ssize_t len, const uint32_t *k1,
                            const uint32_t *k2, uint64_t *s1, uint64_t *s2)
{
    for (Py_ssize_t i = i0; i < len; i += 2) {
        unsigned l = (unsigned)(i >> 1) & 3;
        uint64_t b1 = i + 1 < len ? (uint32_t)(t[i + 1] + k1[i + 1]) : k1[i + 1];
        uint64_t b2 = i + 1 < len ? (uint32_t)(t[i + 1] + k2[i + 1]) : k2[i + 1];
        s1[l] += (uint64_t)(uint32_t)(t[i] + k1[i]) * b1;
        s2[l] += (uint64_t)(uint32_t)(t[i] + k2[i]) * b2;
    }
}

/* The lane chains after a block of `len` tokens with lane sums s1/s2. */
static inline void lanes_step(uint64_t *c1, uint64_t *c2, const FpArgs *f, uint64_t *s1, uint64_t *s2,
                              Py_ssize_t len)
{
    s1[0] ^= (uint64_t)len << 48;
    s2[0] ^= (uint64_t)len << 40;
    for (int l = 0; l < 4; l++) {
        c1[l] = c1[l] * f->p1 + s1[l];
        c2[l] = c2[l] * f->p2 + s2[l];
    }
}

/* Block b's fingerprint (fp[2b], fp[2b+1]) from its lane chains. */
static inline void lanes_fold(const uint64_t *c1, const uint64_t *c2, const FpArgs *f, uint64_t *fp,
                              Py_ssize_t b)
{
    fp[2 * b] = c1[0] * f->r1[0] + c1[1] * f->r1[1] + c1[2] * f->r1[2] + c1[3] * f->r1[3];
    fp[2 * b + 1] = c2[0] * f->r2[0] + c2[1] * f->r2[1] + c2[2] * f->r2[2] + c2[3] * f->r2[3];
}

#if defined(__x86_64__)
#include <immintrin.h>

/* NH of 8 tokens at block offset j (vpmuludq: even lanes of t + k times the odd ones). */
__attribute__((target("avx2"))) static inline __m256i nh8(__m256i x, const uint32_t *k, __m256i s)
{
    __m256i y = _mm256_add_epi32(x, _mm256_loadu_si256((const __m256i *)k));
    return _mm256_add_epi64(s, _mm256_mul_epu32(y, _mm256_srli_epi64(y, 32)));
}

/* c * p mod 2**64 per 64-bit lane, p below 2**32 (AVX2 has no 64-bit multiply) */
__attribute__((target("avx2"))) static inline __m256i mul64x32(__m256i c, __m256i p)
{
    __m256i lo = _mm256_mul_epu32(c, p), hi = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), p);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

/* The lane chains after one whole block (lanes_step, vectorised). */
__attribute__((target("avx2"))) static inline void lanes_step8(__m256i *c1, __m256i *c2, __m256i p1,
                                                               __m256i p2, __m256i s1, __m256i s2,
                                                               __m256i tag1, __m256i tag2)
{
    *c1 = _mm256_add_epi64(mul64x32(*c1, p1), _mm256_xor_si256(s1, tag1));
    *c2 = _mm256_add_epi64(mul64x32(*c2, p2), _mm256_xor_si256(s2, tag2));
}
#endif

/* Whether the cache reads block b's fingerprint (of nb blocks): a checkpoint or the last. */
static inline int fp_wanted(Py_ssize_t b, Py_ssize_t nb) { return (b + 1) % CHECKPOINT == 0 || b == nb - 1; }

/* Whether v1_run_u32 takes its one-loop path for this block size (x86-64 with AVX2, tpb a
 * multiple of 8); elsewhere it falls back to v1_run (and fingerprints are the caller's). */
SD_HIDDEN int v1_fused_ok(Py_ssize_t tpb);
/* Whether the AVX2 code runs (x86-64 with AVX2, unless _v1_impl(True) forced the portable code). */
SD_HIDDEN int v1_avx2(void);
/* v1 keys of blocks first_block.. of tok[0, usable) (u32 tokens, any alignment) chained on
 * `parent`, as v1_run; with `fa` (first_block 0 only), also the fingerprints the cache reads
 * (fp_wanted blocks, into fp[2 b], fp[2 b + 1]), computed in the same loop. Only where
 * v1_fused_ok(tpb). */
SD_HIDDEN void v1_run_u32(const uint32_t *tok, Py_ssize_t usable, Py_ssize_t tpb, int salted,
                          uint64_t salt, Py_ssize_t first_block, uint64_t parent, uint64_t *out,
                          const FpArgs *fa, uint64_t *fp);

/* Arguments (tokens, tokens_per_block, salt_id=None[, lora_id=None, token_bytes=4]). */
typedef struct {
    Tokens tok;
    Py_ssize_t tpb, usable, nblocks;
    int salted, lora;
    uint64_t salt, lora_id;
    int token_bytes;
} HashArgs;

SD_HIDDEN int hash_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                        int v2, HashArgs *a);
SD_HIDDEN int opt_u64(PyObject *o, const char *what, int *present, uint64_t *out);

#define TOKEN_CHUNK 512 /* tokens converted per step where a chunk buffer is used */

/* MurmurHash3's 64-bit finalizer (fmix64): spreads a key over every bit before masking. */
static inline uint64_t fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDULL;
    k ^= k >> 33;
    k *= 0xC4CEB9FE1A85EC53ULL;
    k ^= k >> 33;
    return k;
}

#endif
