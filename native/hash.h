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

/* The prefix cache's fingerprint chains (hashcache.c): NH keys k1, k2 (tpb + 2 each), the chains'
odd multipliers and their values before the first block fingerprinted. */
typedef struct {
    const uint32_t *k1, *k2;
    uint64_t p1, p2, c1, c2;
    Py_ssize_t tpb;
} FpArgs;

/* NH sums of t[0, len) added to s1/s2 under keys k1/k2 (an odd last token pairs with its key). */
static inline void nh2_tail(const uint32_t *t, Py_ssize_t len, const uint32_t *k1, const uint32_t *k2,
                            uint64_t *s1, uint64_t *s2)
{
    Py_ssize_t i = 0;
    for (; i + 1 < len; i += 2) {
        *s1 += (uint64_t)(uint32_t)(t[i] + k1[i]) * (uint32_t)(t[i + 1] + k1[i + 1]);
        *s2 += (uint64_t)(uint32_t)(t[i] + k2[i]) * (uint32_t)(t[i + 1] + k2[i + 1]);
    }
    if (i < len) {
        *s1 += (uint64_t)(uint32_t)(t[i] + k1[i]) * k1[i + 1];
        *s2 += (uint64_t)(uint32_t)(t[i] + k2[i]) * k2[i + 1];
    }
}

/* A block's fingerprint step: c = c * P + (nh ^ len tag), one chain per key. */
static inline void fp_step(uint64_t *c1, uint64_t *c2, const FpArgs *f, uint64_t a1, uint64_t a2,
                           Py_ssize_t len, uint64_t *fp)
{
    fp[0] = *c1 = *c1 * f->p1 + (a1 ^ ((uint64_t)len << 48));
    fp[1] = *c2 = *c2 * f->p2 + (a2 ^ ((uint64_t)len << 40));
}

/* Whether v1_run_u32 takes its one-loop path for this block size (x86-64 with AVX2, tpb a
 * multiple of 8); elsewhere it falls back to v1_run (and fingerprints are the caller's). */
SD_HIDDEN int v1_fused_ok(Py_ssize_t tpb);
/* v1 keys of blocks first_block.. of tok[0, usable) (u32 tokens, any alignment) chained on
 * `parent`, as v1_run; with `fa`, also the fingerprints of those blocks into fp[2 b], fp[2 b + 1]
 * (chains continuing from fa->c1/c2), computed in the same loop. Only where v1_fused_ok(tpb). */
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
