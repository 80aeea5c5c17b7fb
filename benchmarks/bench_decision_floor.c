/*
 * The floors under a routing decision's hash and pick, measured alone (BENCHMARKS.md, "Decision
 * cost, 1k to 128k tokens"). Three experiments, each the minimum over many runs:
 *
 *   gcc -O2 -o /tmp/bdf benchmarks/bench_decision_floor.c
 *   /tmp/bdf chain            # v1 over 32k tokens: the bare chain, a premix pass then the chain
 *                             # (the old loop), premix and NH fingerprints in the chain's shadow
 *                             # (native/hash.c v1_run_u32), and a separate fingerprint pass
 *   /tmp/bdf insert [huge]    # pick_kv's commit on 1,024 random slots of a 128 MiB shared table,
 *                             # all cold: loads only, CAS + fetch_or in one pass, two passes
 *   /tmp/bdf overlap [huge]   # a prefetch (or a load) of each block's slot inside the v1 chain,
 *                             # so that the pick's slots arrive while it hashes: chain and walk
 *
 * `huge` puts the table on 2 MiB pages as the index segments are (shm_open, one fallocated page
 * per 2 MiB, MADV_COLLAPSE, a 2 MiB-aligned MAP_SHARED mapping: native/mapping.c). "All cold" is a
 * 64 MiB write to other memory before each run: slots, page-table lines and TLB evicted. The
 * cycle count of the chain is calibrated with a run of dependent adds (1 cycle each).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define NT 32768 /* tokens */
#define TPB 32
#define NB (NT / TPB)
#define REPS 41
#define SLOTS ((size_t)1 << 22) /* 4M slots of 32 B: the bench's index */

static uint32_t tok[NT], pm[NT], keys[2 * (TPB + 2)];
uint64_t hs[NB], fp[2 * NB]; /* not static: their stores are kept */
static uint64_t *tab;
static char *junk;
static const size_t junklen = (size_t)64 << 20;

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void all_cold(void)
{
    for (size_t i = 0; i < junklen; i += 64)
        junk[i]++;
}

/* ---- v1 (native/hash.c) ------------------------------------------------------------------ */

static inline uint32_t premix(uint32_t v)
{
    v = ((v >> 16) ^ v) * 0x45D9F3Bu;
    v = ((v >> 16) ^ v) * 0x45D9F3Bu;
    return ((v >> 16) ^ v) + 0x9E3779B9u;
}

static inline uint64_t chain_step(uint64_t seed, uint64_t v)
{
    uint64_t a, b;
    __asm__("lea (,%[s],8), %[a]\n\tmov %[s], %[b]\n\tshr $2, %[b]\n\tadd %[v], %[b]\n\t"
            "lea (%[b],%[a],8), %[a]\n\txor %[a], %[s]"
            : [s] "+r"(seed), [a] "=&r"(a), [b] "=&r"(b)
            : [v] "r"(v));
    return seed;
}

static inline uint64_t *slot_of(uint64_t key) { return tab + ((key * 0x9E3779B97F4A7C15ULL) >> 42) * 4; }

__attribute__((target("avx2"), optimize("O3"))) static void premix_pass(const uint32_t *v, uint32_t *o, int n)
{
    for (int i = 0; i < n; i++)
        o[i] = premix(v[i]);
}

/* the chain over premixed tokens; touch 1: prefetch each block's slot, 2: load it */
static void chain(const uint32_t *p, int touch)
{
    uint64_t parent = 0;
    for (int b = 0; b < NB; b++) {
        uint64_t seed = TPB ^ (parent * 0xBF58476D1CE4E5B9ULL);
        for (int i = 0; i < TPB; i++)
            seed = chain_step(seed, p[b * TPB + i]);
        hs[b] = parent = seed;
        if (touch == 1)
            __builtin_prefetch(slot_of(seed), 1);
        else if (touch == 2)
            (void)*(volatile uint64_t *)slot_of(seed);
    }
}

__attribute__((target("avx2"))) static inline __m256i premix8(__m256i x)
{
    const __m256i h = _mm256_set1_epi32(0x45D9F3B), c = _mm256_set1_epi32((int)0x9E3779B9u);
    x = _mm256_mullo_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), h);
    x = _mm256_mullo_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), h);
    return _mm256_add_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), c);
}

__attribute__((target("avx2"))) static inline __m256i nh8(__m256i x, const uint32_t *k, __m256i s)
{
    __m256i y = _mm256_add_epi32(x, _mm256_loadu_si256((const __m256i *)k));
    return _mm256_add_epi64(s, _mm256_mul_epu32(y, _mm256_srli_epi64(y, 32)));
}

/* premix (and with nh, NH lane sums folded into lane chains) of group g + 1 before chaining group g */
__attribute__((target("avx2"))) static void fused(int nh)
{
    uint32_t ring[2][8] __attribute__((aligned(32)));
    uint64_t parent = 0, seed = TPB;
    const int groups = NT / 8, per_block = TPB / 8;
    __m256i s1 = _mm256_setzero_si256(), s2 = s1, c1 = _mm256_set1_epi64x(1), c2 = _mm256_set1_epi64x(2);
    const __m256i p = _mm256_set1_epi64x(0x9E3779B1);
    _mm256_store_si256((__m256i *)ring[0], premix8(_mm256_loadu_si256((const __m256i *)tok)));
    for (int g = 0; g < groups; g++) {
        const uint32_t *v = ring[g & 1];
        int h = g + 1;
        if (h < groups) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(tok + 8 * h));
            if (nh) {
                int j = h % per_block * 8;
                if (j == 0) {
                    __m256i lo = _mm256_mul_epu32(c1, p), hi = _mm256_mul_epu32(_mm256_srli_epi64(c1, 32), p);
                    c1 = _mm256_add_epi64(_mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)), s1);
                    lo = _mm256_mul_epu32(c2, p), hi = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), p);
                    c2 = _mm256_add_epi64(_mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)), s2);
                    s1 = s2 = _mm256_setzero_si256();
                }
                s1 = nh8(x, keys + j, s1);
                s2 = nh8(x, keys + TPB + 2 + j, s2);
            }
            _mm256_store_si256((__m256i *)ring[h & 1], premix8(x));
        }
        for (int i = 0; i < 8; i++)
            seed = chain_step(seed, v[i]);
        if (h % per_block == 0) {
            hs[h / per_block - 1] = parent = seed;
            seed = TPB ^ (parent * 0xBF58476D1CE4E5B9ULL);
        }
    }
    _mm256_storeu_si256((__m256i *)fp, _mm256_add_epi64(c1, c2));
}

/* the old prefix cache's fingerprint pass: NH per block, a horizontal sum, two scalar chains */
__attribute__((target("avx2"))) static void fingerprint_pass(void)
{
    uint64_t c1 = 1, c2 = 2;
    for (int b = 0; b < NB; b++) {
        __m256i s1 = _mm256_setzero_si256(), s2 = s1;
        for (int i = 0; i < TPB; i += 8) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(tok + b * TPB + i));
            s1 = nh8(x, keys + i, s1);
            s2 = nh8(x, keys + TPB + 2 + i, s2);
        }
        __m128i h1 = _mm_add_epi64(_mm256_castsi256_si128(s1), _mm256_extracti128_si256(s1, 1));
        __m128i h2 = _mm_add_epi64(_mm256_castsi256_si128(s2), _mm256_extracti128_si256(s2, 1));
        fp[2 * b] = c1 = c1 * 0x9E3779B97F4A7C15ULL + (uint64_t)_mm_cvtsi128_si64(h1) + (uint64_t)_mm_extract_epi64(h1, 1);
        fp[2 * b + 1] = c2 = c2 * 0xBF58476D1CE4E5B9ULL + (uint64_t)_mm_cvtsi128_si64(h2) + (uint64_t)_mm_extract_epi64(h2, 1);
    }
}

static uint64_t dep_adds(uint64_t x, long n)
{
    for (long i = 0; i < n; i += 8)
        __asm__("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
                : "+r"(x));
    return x;
}

static void run_chain(void)
{
    uint64_t best[6] = {~0ULL, ~0ULL, ~0ULL, ~0ULL, ~0ULL, ~0ULL}, t[7], ref[NB];
    volatile uint64_t sink = 0;
    for (int r = 0; r < 2000; r++) {
        t[0] = now_ns();
        sink += dep_adds((uint64_t)r, 131072);
        t[1] = now_ns();
        chain(pm, 0); /* pm premixed by the previous run's pass (the first run's is not kept) */
        t[2] = now_ns();
        premix_pass(tok, pm, NT);
        chain(pm, 0);
        t[3] = now_ns();
        memcpy(ref, hs, sizeof ref);
        fused(0);
        t[4] = now_ns();
        fused(1);
        t[5] = now_ns();
        sink += fp[0] + fp[1];
        fingerprint_pass();
        t[6] = now_ns();
        sink += fp[2 * NB - 1]; /* the fingerprints are used: the compiler keeps their work */
        if (r > 0 && memcmp(ref, hs, sizeof ref) != 0) {
            printf("fused keys differ from the reference\n");
            exit(1);
        }
        for (int k = 0; k < 6; k++)
            if (r > 0 && t[k + 1] - t[k] < best[k])
                best[k] = t[k + 1] - t[k];
    }
    double ghz = 131072.0 / (double)best[0];
    printf("clock %.2f GHz (131072 dependent adds in %.1f us); 32k tokens, us:\n", ghz, best[0] / 1e3);
    printf("  bare chain                  %6.2f (%.2f cycles a token)\n", best[1] / 1e3, best[1] * ghz / NT);
    printf("  premix pass, then chain     %6.2f\n", best[2] / 1e3);
    printf("  premix in the chain's shadow %5.2f\n", best[3] / 1e3);
    printf("  ... and NH fingerprints     %6.2f\n", best[4] / 1e3);
    printf("  fingerprint pass (old)      %6.2f\n", best[5] / 1e3);
    (void)sink;
}

/* ---- the pick's slots -------------------------------------------------------------------- */

static void map_table(int huge)
{
    const size_t len = SLOTS * 32, H = (size_t)2 << 20;
    char name[64];
    snprintf(name, sizeof name, "/bdf-%d", (int)getpid());
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    shm_unlink(name);
    if (fd < 0) {
        perror("shm_open");
        exit(1);
    }
    if (huge) {
        posix_fallocate(fd, (off_t)len - 1, 1);
        for (size_t off = 0; off < len; off += H)
            posix_fallocate(fd, (off_t)off, 4096);
    }
    char *res = mmap(NULL, len + H, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    char *at = (char *)(((uintptr_t)res + H - 1) & ~(uintptr_t)(H - 1));
    tab = mmap(at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (huge && madvise(tab, len, 25 /* MADV_COLLAPSE */) != 0)
        printf("(MADV_COLLAPSE refused: 4 KiB pages)\n");
    posix_fallocate(fd, 0, (off_t)len);
    memset(tab, 0, len);
}

static uint64_t rng = 88172645463325252ULL;
static uint64_t xorshift(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void commit(int mode)
{
    uint64_t *s, e, *sl[NB];
    for (int j = 0; j < 16; j++)
        __builtin_prefetch(slot_of(hs[j]), 1);
    for (int j = 0; j < NB; j++) {
        if (j + 16 < NB)
            __builtin_prefetch(slot_of(hs[j + 16]), 1);
        s = sl[j] = slot_of(hs[j]);
        e = __atomic_load_n(s, __ATOMIC_ACQUIRE);
        if (mode == 1) {
            __atomic_compare_exchange_n(s, &e, hs[j], 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
            __atomic_store_n(&s[3], (uint64_t)j, __ATOMIC_RELAXED);
            __atomic_fetch_or(&s[2], 1, __ATOMIC_RELEASE);
        }
    }
    if (mode == 2)
        for (int j = 0; j < NB; j++) {
            s = sl[j];
            e = __atomic_load_n(s, __ATOMIC_ACQUIRE);
            __atomic_compare_exchange_n(s, &e, hs[j], 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
            __atomic_store_n(&s[3], (uint64_t)j, __ATOMIC_RELAXED);
            __atomic_fetch_or(&s[2], 1, __ATOMIC_RELEASE);
        }
}

static void run_insert(int huge)
{
    static const char *names[] = {"loads only", "CAS + fetch_or", "two passes"};
    map_table(huge);
    for (int mode = 0; mode < 3; mode++) {
        uint64_t t[REPS];
        for (int r = 0; r < REPS; r++) {
            for (int j = 0; j < NB; j++)
                hs[j] = xorshift();
            all_cold();
            uint64_t a = now_ns();
            commit(mode);
            t[r] = now_ns() - a;
        }
        qsort(t, REPS, sizeof t[0], cmp_u64);
        printf("%s pages, %-15s %5.1f ns a slot (min %5.1f)\n", huge ? "2 MiB" : "4 KiB", names[mode],
               (double)t[REPS / 2] / NB, (double)t[0] / NB);
    }
}

static void run_overlap(int huge)
{
    static const char *names[] = {"nothing", "prefetch", "load"};
    map_table(huge);
    for (int touch = 0; touch < 3; touch++) {
        uint64_t tc[REPS], tw[REPS];
        for (int r = 0; r < REPS; r++) {
            for (int i = 0; i < NT; i++)
                tok[i] = (uint32_t)(xorshift() % 150000);
            premix_pass(tok, pm, NT);
            all_cold();
            uint64_t a = now_ns();
            chain(pm, touch);
            uint64_t b = now_ns();
            commit(1);
            tc[r] = b - a;
            tw[r] = now_ns() - b;
        }
        qsort(tc, REPS, sizeof tc[0], cmp_u64);
        qsort(tw, REPS, sizeof tw[0], cmp_u64);
        printf("%s pages, %-8s in the chain: chain %6.1f us (min %6.1f), then the commit %5.1f us (min %5.1f)\n",
               huge ? "2 MiB" : "4 KiB", names[touch], tc[REPS / 2] / 1e3, tc[0] / 1e3, tw[REPS / 2] / 1e3,
               tw[0] / 1e3);
    }
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "chain";
    int huge = argc > 2 && strcmp(argv[2], "huge") == 0;
    for (int i = 0; i < NT; i++)
        tok[i] = (uint32_t)(xorshift() % 150000);
    for (int i = 0; i < 2 * (TPB + 2); i++)
        keys[i] = (uint32_t)xorshift();
    junk = malloc(junklen);
    memset(junk, 0, junklen);
    if (strcmp(what, "chain") == 0)
        run_chain();
    else if (strcmp(what, "insert") == 0)
        run_insert(huge);
    else if (strcmp(what, "overlap") == 0)
        run_overlap(huge);
    else
        printf("usage: %s chain | insert [huge] | overlap [huge]\n", argv[0]);
    return 0;
}
