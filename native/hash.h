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
